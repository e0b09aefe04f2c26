"""The DSpark draft model: a DFlash block backbone plus a Markov head and a confidence head.

Conventions (see shared docs, dspark-contract.md):

* The target's auxiliary features are the outputs of decoder layers
  ``target_layer_ids`` (layer ``i`` = HF ``hidden_states[i + 1]``), concatenated,
  fused once by ``hidden_norm(fc(.))`` into the draft's context ``ctx``.
* A block at anchor position ``p`` holds ``[x_p, MASK, ..., MASK]`` at positions
  ``p .. p + block_size - 1``; it attends to context positions strictly before
  ``p`` and to all of its own slots.
* Slot ``k`` predicts token ``p + k + 1``; every slot, the anchor slot included,
  is a prediction slot.
* Keys and values are injected: every layer projects ``ctx`` with its own
  ``k_proj``/``v_proj`` (no input norm on ``ctx``; it was normed once by
  ``hidden_norm``) and the block with the same projections after
  ``input_layernorm``. Queries come from the block only.
* The Markov head and the confidence head read the post-norm hidden state
  ``h_k`` (the one fed to ``lm_head``) and the Markov embedding of the token
  before slot ``k`` (the anchor for ``k = 0``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from draftforge.errors import InputError
from draftforge.train.blocks import (
    BlockLayout,
    block_input_ids,
    build_layout,
    dense_block_mask,
    flex_block_mask,
)
from draftforge.train.objective import ObjectiveOutput, dspark_objective

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
ATTENTION_BACKENDS = ("sdpa", "flex")
POSITIVE_INT_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "target_hidden_size", "num_target_layers", "head_dim",
    "max_position_embeddings",
)  # fmt: skip


@dataclass
class DSparkConfig:
    """Everything needed to build a draft; field names match the exported config.json."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    target_hidden_size: int
    num_target_layers: int
    target_layer_ids: list[int] = field(default_factory=list)
    head_dim: int | None = None
    block_size: int = 8
    mask_token_id: int = 0
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    attention_backend: str = "sdpa"

    def __post_init__(self) -> None:
        # A config.json read back (eval, export) arrives here unchecked: a zero or negative size
        # would divide by zero, fail deep in nn.Linear or build a draft without heads, and a
        # zero eps or theta turns the zero context rows of padding or every RoPE angle into NaN.
        for name in POSITIVE_INT_FIELDS:
            value = getattr(self, name)
            if value is None and name == "head_dim":  # derived below
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("block_size", "mask_token_id", "markov_rank"):
            value = getattr(self, name)  # a float (8.0) or string would fail deep in torch, or not at all
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not isinstance(self.target_layer_ids, list | tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in self.target_layer_ids
        ):
            raise ValueError(f"target_layer_ids must be a list of integer layer ids, got {self.target_layer_ids!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} does not divide into "
                    f"{self.num_attention_heads} attention heads; set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim must be even (RoPE rotates the two halves of each head), got {self.head_dim}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must not be empty")
        for layer_id in self.target_layer_ids:
            if not 0 <= layer_id < self.num_target_layers - 1:
                raise ValueError(
                    f"target layer id {layer_id} is outside [0, {self.num_target_layers - 2}] "
                    f"(the target has {self.num_target_layers} layers; its final layer is not allowed)"
                )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})"
            )
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"markov_head_type {self.markov_head_type!r} is not one of {MARKOV_HEAD_TYPES}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend {self.attention_backend!r} is not one of {ATTENTION_BACKENDS}"
            )
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.confidence_head_with_markov and self.enable_confidence_head and not self.markov_rank:
            raise ValueError("confidence_head_with_markov needs markov_rank > 0")
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"draft hidden_size {self.hidden_size} must equal the target's hidden size "
                f"{self.target_hidden_size}: the draft reuses the target's embedding and lm_head"
            )

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids) * self.target_hidden_size

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as Qwen3 and Llama do."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [..., L, head_dim] for absolute ``positions`` [..., L] (half-rotation layout)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    angles = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, heads, L, D] by cos/sin [B, L, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class InjectedAttention(nn.Module):
    """Block self-attention whose keys and values also cover the fused target context."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, proj: nn.Linear, num_heads: int) -> torch.Tensor:
        batch, length, _ = x.shape
        return proj(x).view(batch, length, num_heads, self.head_dim).transpose(1, 2)

    def context_kv(
        self, ctx: torch.Tensor, ctx_rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx [B, S, H] (fused context) -> its injected keys (normed, rotated) and values,
        each [B, kv_heads, S, head_dim]. Each position's pair depends on that position alone,
        so a decoder can keep the pairs of a growing context and add only the new positions'."""
        k = apply_rope(self.k_norm(self._heads(ctx, self.k_proj, self.num_kv_heads)), *ctx_rope)
        return k, self._heads(ctx, self.v_proj, self.num_kv_heads)

    def forward(
        self,
        x: torch.Tensor,
        ctx_kv: tuple[torch.Tensor, torch.Tensor],
        block_rope: tuple[torch.Tensor, torch.Tensor],
        attend,
    ) -> torch.Tensor:
        """x [B, L, H] (normed block), ctx_kv from :meth:`context_kv` -> [B, L, H]."""
        q = apply_rope(self.q_norm(self._heads(x, self.q_proj, self.num_heads)), *block_rope)
        k_block = apply_rope(self.k_norm(self._heads(x, self.k_proj, self.num_kv_heads)), *block_rope)
        k = torch.cat([ctx_kv[0], k_block], dim=2)
        v = torch.cat([ctx_kv[1], self._heads(x, self.v_proj, self.num_kv_heads)], dim=2)
        out = attend(q, k, v)
        batch, _, length, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Qwen3-style pre-norm layer with KV injection."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = InjectedAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, block_rope, attend, *, ctx=None, ctx_rope=None, ctx_kv=None) -> torch.Tensor:
        """The block ``h`` over the fused context ``ctx`` at ``ctx_rope``, or over its keys and
        values ``ctx_kv`` when a decoder kept them. Training passes ``ctx``: the projections run
        inside this module's forward, where FSDP2 has gathered its parameters."""
        if ctx_kv is None:
            ctx_kv = self.self_attn.context_kv(ctx, ctx_rope)
        h = h + self.self_attn(self.input_layernorm(h), ctx_kv, block_rope, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class MarkovHead(nn.Module):
    """Previous-token correction of the block logits: ``logits_k = U_k + W2(latent_k)``.

    ``vanilla``: latent = W1[prev]. ``gated``: latent = sigmoid(gate_proj([h; W1[prev]])) * W1[prev].
    ``rnn``: a gated recurrence over the block,
    ``g, c, o = joint_proj([state; W1[prev]; h])``, ``state' = g*state + (1-g)*tanh(c)``,
    latent = tanh(o). The rnn state starts at zero for every block.
    """

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        rank, hidden = cfg.markov_rank, cfg.hidden_size
        self.head_type = cfg.markov_head_type
        self.rank = rank
        self.markov_w1 = nn.Embedding(cfg.vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, cfg.vocab_size, bias=False)
        if self.head_type == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif self.head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def initial_state(self, leading: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(*leading, self.rank)

    def step(
        self, prev_tokens: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One slot: prev_tokens [...], hidden [..., H], state [..., r] -> (latent, embedding, state)."""
        emb = self.markov_w1(prev_tokens)
        if self.head_type == "vanilla":
            return emb, emb, state
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, emb.to(hidden.dtype)], dim=-1)))
            return gate.to(emb.dtype) * emb, emb, state
        joint = self.joint_proj(torch.cat([state, emb.to(hidden.dtype), hidden], dim=-1))
        gate_raw, candidate_raw, out_raw = joint.chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate_raw)
        return torch.tanh(out_raw), emb, state

    def teacher_forced(
        self, prev_tokens: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All slots at once with the true previous tokens [N, γ] -> (latent, embedding) [N, γ, r]."""
        if self.head_type != "rnn":
            latent, emb, _ = self.step(prev_tokens, hidden, None)
            return latent, emb
        state = self.initial_state(prev_tokens.shape[:1], hidden)
        latents, embs = [], []
        for k in range(prev_tokens.shape[1]):
            latent, emb, state = self.step(prev_tokens[:, k], hidden[:, k], state)
            latents.append(latent)
            embs.append(emb)
        return torch.stack(latents, dim=1), torch.stack(embs, dim=1)


class ConfidenceHead(nn.Module):
    """``z_k = proj([h_k; W1[prev]])`` (or ``proj(h_k)``); ``sigmoid(z_k)`` estimates acceptance."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.with_markov = cfg.confidence_head_with_markov
        extra = cfg.markov_rank if self.with_markov else 0
        self.proj = nn.Linear(cfg.hidden_size + extra, 1)

    def forward(self, hidden: torch.Tensor, markov_emb: torch.Tensor | None) -> torch.Tensor:
        if self.with_markov:
            hidden = torch.cat([hidden, markov_emb.to(hidden.dtype)], dim=-1)
        return self.proj(hidden).squeeze(-1)


def sdpa_attend(mask: torch.Tensor | None):
    """Attention through SDPA with a dense boolean mask [B, Lq, Lk] (True = visible) or none."""

    def attend(q, k, v):
        if k.shape[1] != q.shape[1]:
            groups = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        attn_mask = None if mask is None else mask.unsqueeze(1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)

    return attend


_COMPILED_FLEX = None
FLEX_MIN_HEAD_DIM = 16  # inductor's flex_attention kernel refuses smaller heads (seen on an H200)


def flex_attend(block_mask):
    """Attention through flex_attention with a BlockMask (GPU training path).

    On CUDA the kernel is compiled once per process (uncompiled flex attention
    materialises the full score matrix) and shape-generic (``dynamic=True``): a
    batch's length is its longest sequence, so a static kernel would recompile for
    every new length and, past dynamo's recompile limit, fall back to the eager
    path. On CPU it runs eager, forward only: training there is refused, naming the setting
    (torch's own error does not).
    """
    from torch.nn.attention.flex_attention import flex_attention

    def attend(q, k, v):
        global _COMPILED_FLEX
        kernel = flex_attention
        if q.device.type in ("cpu", "mps") and any(x.requires_grad for x in (q, k, v)):
            raise InputError(
                f"draft.attention_backend: flex cannot train on {q.device.type.upper()} (torch's "
                "flex attention has no backward there); use draft.attention_backend: sdpa, or "
                "train on a GPU.")
        if q.is_cuda:
            if q.shape[-1] < FLEX_MIN_HEAD_DIM:
                raise ValueError(
                    f"draft.attention_backend 'flex' on CUDA needs draft.head_dim >= "
                    f"{FLEX_MIN_HEAD_DIM} (its compiled kernel's minimum); this draft has head_dim "
                    f"{q.shape[-1]}. Use draft.attention_backend: sdpa or a larger head_dim.")
            if _COMPILED_FLEX is None:
                _COMPILED_FLEX = torch.compile(flex_attention, dynamic=True)
            kernel = _COMPILED_FLEX
        return kernel(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])

    return attend


class ContextCache:
    """The draft's injected context keys and values of one sequence being decoded.

    The context only grows while a sequence is decoded (accepted tokens are appended), and
    each position's keys and values depend on that position alone, so :meth:`extend` projects
    only the positions added since the last block. Start a new cache (or :meth:`clear` this
    one) for each sequence: :meth:`extend` refuses a context whose last held position's
    features differ from those it projected (another sequence's, in a cache not cleared).
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.length, self.kv = 0, []
        self.last: torch.Tensor | None = None  # the features of position length - 1, as projected

    def extend(self, draft: DSparkDraft, aux: torch.Tensor, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys and values of positions ``0 .. length - 1``, projecting
        ``aux[:, self.length:length]``; ``aux`` [B, >= length, K*H_t] is the whole context."""
        if length < self.length:
            raise ValueError(
                f"the draft's context cache holds {self.length} positions and the block asks for "
                f"{length}: a new sequence needs a new cache (ContextCache.clear)"
            )
        if self.last is not None and not torch.allclose(aux[:, self.length - 1], self.last, rtol=0, atol=0,
                                                        equal_nan=True):  # NaN features: the same context
            raise ValueError(
                f"the draft's context cache holds {self.length} positions of another context (the "
                f"features of position {self.length - 1} differ): a new sequence needs a new cache "
                "(ContextCache.clear)"
            )
        if length > self.length or not self.kv:
            new = draft.context_kv(aux[:, self.length : length], start=self.length)
            if self.kv:
                new = [(torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
                       for (k, v), (nk, nv) in zip(self.kv, new, strict=True)]
            self.kv, self.length = new, length
            self.last = aux[:, length - 1].clone() if length else None
        return self.kv


class DSparkDraft(nn.Module):
    """The draft. Trainable: fc, hidden_norm, layers, norm, Markov and confidence heads."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(cfg.num_context_features, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.markov_head = MarkovHead(cfg) if cfg.markov_rank > 0 else None
        self.confidence_head = ConfidenceHead(cfg) if cfg.enable_confidence_head else None
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int | None = None) -> None:
        """Normal(0, std) linears, ones for norms, small Markov W2 so training starts near DFlash."""
        generator = None
        if seed is not None:
            generator = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if name in ("embed_tokens.weight", "lm_head.weight"):
                continue
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                values = torch.randn(param.shape, generator=generator) * std
                param.copy_(values.to(param.dtype))
        if self.markov_head is not None:
            self.markov_head.markov_w2.weight.mul_(0.1)
        # Output projections scaled by depth, as in GPT-2 style inits.
        scale = 1.0 / math.sqrt(2 * max(1, len(self.layers)))
        for layer in self.layers:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)

    @torch.no_grad()
    def load_target_embeddings(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> None:
        """Copy the target's frozen embedding and lm_head [V, H]."""
        for name, src, dst in (
            ("embed_tokens", embed_tokens, self.embed_tokens.weight),
            ("lm_head", lm_head, self.lm_head.weight),
        ):
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(
                    f"target {name} has shape {tuple(src.shape)}, the draft expects {tuple(dst.shape)}"
                )
            dst.copy_(src.to(dst.dtype))

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    def fuse_context(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, S, K*H_t] -> ctx [B, S, H]."""
        cfg = self.config
        if aux.shape[-1] != cfg.num_context_features:
            raise ValueError(
                f"the target features (aux) have {aux.shape[-1]} values per position, the draft "
                f"expects {cfg.num_context_features}: {len(cfg.target_layer_ids)} target layers "
                f"{list(cfg.target_layer_ids)} x the target's hidden size {cfg.target_hidden_size}; "
                "were they captured from another target or with other draft.target_layer_ids?"
            )
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def context_kv(self, aux: torch.Tensor, start: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Inference: aux [B, S, K*H_t] of positions ``start .. start + S - 1`` -> every layer's
        injected keys and values of those positions (:meth:`InjectedAttention.context_kv`).
        Not for a sharded draft: it calls the layers' projections outside their forward."""
        ctx, ctx_rope = self.fuse_context(aux), self._rope(start, aux.shape[1], aux)
        return [layer.self_attn.context_kv(ctx, ctx_rope) for layer in self.layers]

    def _rope(self, start: int, length: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, start + length, device=like.device).expand(like.shape[0], -1)
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, self.fc.weight.dtype)

    def backbone(
        self,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        attend,
        *,
        ctx: torch.Tensor | None = None,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Block tokens [B, L] at positions [B, L] over the fused context ``ctx`` [B, S, H] at
        positions 0 .. S - 1, or over every layer's context keys and values ``ctx_kv``
        (:meth:`context_kv`) -> post-norm h [B, L, H]."""
        cfg = self.config
        h = self.embed_tokens(block_ids).to(self.fc.weight.dtype)
        block_rope = rope_cos_sin(block_positions, cfg.head_dim, cfg.rope_theta, h.dtype)
        ctx_rope = None if ctx is None else self._rope(0, ctx.shape[1], ctx)
        for index, layer in enumerate(self.layers):
            kv = None if ctx_kv is None else ctx_kv[index]
            h = layer(h, block_rope, attend, ctx=ctx, ctx_rope=ctx_rope, ctx_kv=kv)
        return self.norm(h)

    def block_forward(
        self, anchor_token: torch.Tensor, anchor_pos: int, aux: torch.Tensor,
        cache: ContextCache | None = None,
    ) -> torch.Tensor:
        """Inference: one block per sequence. anchor_token [B], aux [B, >= anchor_pos, K*H_t] -> h [B, γ, H].

        The block sees the context positions ``0 .. anchor_pos - 1``. With a ``cache`` (one per
        sequence being decoded), only the positions it does not hold yet are projected, as a
        server keeps the draft's context KV; without one, the whole context is.

        The anchor must lie within ``max_position_embeddings``, as every training anchor does
        (the block's later slots may reach past it, as in training)."""
        cfg = self.config
        if anchor_pos < 0:
            raise ValueError(f"anchor position must be >= 0, got {anchor_pos}")
        if aux.shape[1] < anchor_pos:  # sliced short, the block would see (and a cache keep) less
            raise ValueError(
                f"the block at anchor position {anchor_pos} sees the context positions "
                f"0 .. {anchor_pos - 1}, but aux holds only {aux.shape[1]} positions"
            )
        if anchor_pos >= cfg.max_position_embeddings:
            raise ValueError(
                f"anchor position {anchor_pos} is beyond the draft's max_position_embeddings "
                f"{cfg.max_position_embeddings}: it never saw such positions in training"
            )
        batch = anchor_token.shape[0]
        device = anchor_token.device
        block_ids = torch.full((batch, cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=device)
        block_ids[:, 0] = anchor_token
        block_positions = (anchor_pos + torch.arange(cfg.block_size, device=device)).expand(batch, -1)
        if cache is None:
            return self.backbone(block_ids, block_positions, sdpa_attend(None),
                                 ctx=self.fuse_context(aux[:, :anchor_pos]))
        return self.backbone(block_ids, block_positions, sdpa_attend(None),
                             ctx_kv=cache.extend(self, aux, anchor_pos))

    def packed_hidden(self, input_ids: torch.Tensor, aux: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
        """Training: every block of the batch in one forward -> post-norm h [B, A, γ, H]."""
        cfg = self.config
        batch, seq_len = input_ids.shape
        block_ids = block_input_ids(input_ids, layout.anchors, cfg.block_size, cfg.mask_token_id)
        if cfg.attention_backend == "flex":
            attend = flex_attend(flex_block_mask(layout.anchors, seq_len, cfg.block_size))
        else:
            attend = sdpa_attend(dense_block_mask(layout.anchors, seq_len, cfg.block_size))
        hidden = self.backbone(block_ids, layout.positions.flatten(1), attend, ctx=self.fuse_context(aux))
        return hidden.view(batch, layout.num_anchors, cfg.block_size, -1)

    def forward(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        aux: torch.Tensor,
        final: torch.Tensor,
        anchors: torch.Tensor,
        anchor_valid: torch.Tensor,
        objective: dict | None = None,
        reduce_sum=None,
        denominator: torch.Tensor | None = None,
    ) -> ObjectiveOutput:
        """Packed training forward and the objective for a batch.

        input_ids / loss_mask [B, S]; aux [B, S, K*H_t]; final [B, S, H_t] (the
        target's post-norm state); anchors / anchor_valid [B, A] from
        :func:`draftforge.train.blocks.sample_anchors`; ``objective`` holds keyword
        arguments of :func:`dspark_objective` (weights, decay, chunking).
        """
        if final.shape[-1] != self.config.target_hidden_size:
            raise ValueError(
                f"the target's final hidden states have {final.shape[-1]} values per position, the "
                f"draft expects the target's hidden size {self.config.target_hidden_size}; were they "
                "captured from another target?"
            )
        _check_batch_shapes(input_ids, loss_mask, aux, final, anchors, anchor_valid)
        layout = build_layout(input_ids, loss_mask, anchors, anchor_valid, self.config.block_size)
        hidden = self.packed_hidden(input_ids, aux, layout)
        seq_len = input_ids.shape[1]
        batch_idx = torch.arange(input_ids.shape[0], device=input_ids.device)[:, None, None]
        target_hidden = final[batch_idx, layout.positions.clamp(max=seq_len - 1)]
        return dspark_objective(
            self,
            hidden.flatten(0, 1),
            layout.prev_tokens.flatten(0, 1),
            layout.labels.flatten(0, 1),
            layout.valid.flatten(0, 1),
            target_hidden.flatten(0, 1),
            reduce_sum=reduce_sum,
            denominator=denominator,
            **(objective or {}),
        )

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def draft_block(
        self, hidden: torch.Tensor, anchor_token: torch.Tensor, sample=None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Sequential Markov drafting of one block.

        hidden [B, γ, H]; anchor_token [B]; ``sample(logits [B, V], k) -> tokens [B]``
        (greedy by default). Returns (tokens [B, γ], logits [B, γ, V] fp32,
        confidence logits [B, γ] or None).
        """
        sample = sample or (lambda logits, k: logits.argmax(dim=-1))
        base = self.base_logits(hidden).float()
        prev = anchor_token
        state = None
        if self.markov_head is not None:
            state = self.markov_head.initial_state(prev.shape, hidden)
        tokens, logits, confidences = [], [], []
        for k in range(hidden.shape[1]):
            step_logits = base[:, k]
            emb = None
            if self.markov_head is not None:
                latent, emb, state = self.markov_head.step(prev, hidden[:, k], state)
                step_logits = step_logits + self.markov_head.markov_w2(latent).float()
            if self.confidence_head is not None:
                confidences.append(self.confidence_head(hidden[:, k], emb))
            prev = sample(step_logits, k)
            tokens.append(prev)
            logits.append(step_logits)
        conf = torch.stack(confidences, dim=1) if confidences else None
        return torch.stack(tokens, dim=1), torch.stack(logits, dim=1), conf


def _check_batch_shapes(input_ids, loss_mask, aux, final, anchors, anchor_valid) -> None:
    """Every per-position stream of a training batch covers the same [B, S] positions, and the
    anchors' two tensors agree. Otherwise blocks would read the target features or the target's
    distribution of other positions (a longer ``final`` did so silently), or fail deep inside
    attention or indexing without naming the stream."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
    batch, seq_len = input_ids.shape
    expected = {"loss_mask": (loss_mask, 2), "aux": (aux, 3), "final": (final, 3)}
    for name, (tensor, dims) in expected.items():
        if tensor.dim() != dims or tuple(tensor.shape[:2]) != (batch, seq_len):
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, but input_ids is [{batch}, {seq_len}]: "
                f"{name} must be [batch, seq_len{', features' if dims == 3 else ''}] with the same "
                "batch and positions (one value per token; was a stream shifted, cut or padded "
                "differently?)"
            )
    if anchors.dim() != 2 or anchors.shape[0] != batch or tuple(anchor_valid.shape) != tuple(anchors.shape):
        raise ValueError(
            f"anchors {tuple(anchors.shape)} and anchor_valid {tuple(anchor_valid.shape)} must both be "
            f"[batch={batch}, num_anchors] (see draftforge.train.blocks.sample_anchors)"
        )


def count_parameters(model: nn.Module, *, with_embeddings: bool) -> int:
    """Parameter count as published model cards count it (embeddings optional)."""
    total = 0
    for name, param in model.named_parameters():
        if not with_embeddings and name in ("embed_tokens.weight", "lm_head.weight"):
            continue
        total += param.numel()
    return total
