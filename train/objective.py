"""The acceptance-aware objective (contract section 2), computed in chunks of blocks.

Per slot k with cumulative validity m_k and weight w_k:

* ``CE  = sum w_k * -log p_d,k(x_{p+k+1}) / sum w_k``
* ``TV  = sum w_k * ||p_d,k - p_t,k||_1 / sum w_k``
* ``c*_k = clamp(1 - 0.5 * ||p_d,k - p_t,k||_1, 0, 1)`` (detached)
* ``BCE = sum w_k * BCEWithLogits(z_k, c*_k) / sum w_k``
* ``L = ce_weight * CE + tv_weight * TV + bce_weight * BCE``

and, off by default (not in the contract), ``kl_weight * KL`` with
``KL = sum w_k * KL(p_t,k || p_d,k) / sum w_k``: cross-entropy against the
target's whole distribution instead of the one sampled token.

Weights: ``exp`` gives ``w_k = m_k * exp(-k / decay)``; ``dpace`` gives
``w_k = m_k * prod_{i<k} c*_i`` (detached), the probability that slot k is
reached at all when the earlier slots are verified, so the loss spends its
weight where acceptance is decided. The denominator ``sum w_k`` is summed over
all ranks through ``reduce_sum``.

Vocabulary-sized tensors exist for one chunk of blocks at a time: the fused
function below computes the loss of a chunk and, in the same pass, its
gradient with respect to the chunk's hidden states, Markov latents and the
Markov output matrix (analytic softmax / L1 gradients), so backward never
recomputes or stores the vocabulary tensors. On a CPU, the chunks' logit
gradients are also gathered, up to ``W2_GROUP_BYTES``, for the Markov output
matrix's gradient (:class:`_W2GradientSum`), and the target's logits use a
copy of the frozen lm_head in oneDNN's blocked layout (:func:`_target_logits`).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor
    ce: torch.Tensor
    tv: torch.Tensor
    bce: torch.Tensor
    c_star: torch.Tensor  # [N, γ], zero on invalid slots
    weights: torch.Tensor  # [N, γ]
    valid: torch.Tensor  # [N, γ]
    kl: torch.Tensor | None = None  # sum w KL / sum w; zero unless kl_weight > 0

    def slot_acceptance(self) -> torch.Tensor:
        """Mean c*_k over valid slots, per slot [γ] (NaN where a slot is never valid)."""
        valid = self.valid.float()
        return (self.c_star * valid).sum(0) / valid.sum(0)

    def expected_acceptance_length(self) -> torch.Tensor:
        """tau = 1 + sum_k prod_{i<=k} c*_i, averaged over blocks whose first slot is valid."""
        blocks = self.valid[:, 0]
        if not blocks.any():
            return torch.tensor(float("nan"))
        tau = 1.0 + torch.cumprod(self.c_star[blocks], dim=-1).sum(-1)
        return tau.mean()


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the objective's softmaxes, sums and weights: fp32, or the inputs' own
    dtype where that is wider (a float64 draft gets a float64 loss and gradients, so the
    analytic gradients can be checked against float64 autograd)."""
    return torch.promote_types(dtype, torch.float32)


def exp_weights(valid: torch.Tensor, decay: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    k = torch.arange(valid.shape[-1], device=valid.device, dtype=dtype)
    return valid.to(dtype) * torch.exp(-k / decay)


def dpace_weights(valid: torch.Tensor, c_star: torch.Tensor) -> torch.Tensor:
    reach = torch.cumprod(torch.cat([torch.ones_like(c_star[:, :1]), c_star[:, :-1]], dim=-1), dim=-1)
    return valid.to(c_star.dtype) * reach


def chunk_terms(logits, target_logits, labels, valid, base_weights, ce_weight: float,
                tv_weight: float, dpace: bool, kl_weight: float = 0.0, with_grad: bool = True):
    """The vocabulary-sized, elementwise part of one chunk: CE, TV, KL, c*, weights and d/dlogits.

    ``logits`` / ``target_logits`` [n, γ, V] (the draft's and the target's),
    ``labels`` / ``valid`` / ``base_weights`` [n, γ]. Returns ``(ce, tv, kl, c*, w,
    grad)`` with ``grad = d(ce_weight * sum w CE + tv_weight * sum w TV + kl_weight *
    sum w KL) / dlogits`` in the logits' dtype, or None when not ``with_grad`` (``kl`` is
    zeros when ``kl_weight`` is 0: not computed). Written with in-place ops on its own temporaries, so
    eager mode makes few passes over the vocabulary, and ``torch.compile`` (see
    :func:`compiled_chunk_terms`) fuses them into a handful of loops.
    """
    acc = accumulation_dtype(logits.dtype)  # fp32 at least; float64 stays float64
    probs = torch.log_softmax(logits.to(acc), dim=-1)
    ce = -probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if kl_weight:  # KL(p_t || p_d) = <p_t, log p_t - log p_d>, before probs becomes p_d
        target_logp = torch.log_softmax(target_logits, dim=-1, dtype=acc)
        kl = torch.linalg.vecdot(target_logp.exp(), target_logp.sub_(probs))
        del target_logp
    else:
        kl = torch.zeros_like(ce)
    probs.exp_()  # p_d
    # r = p_t - p_d (softmax upcasts inside the kernel); TV = ||r||_1 without an |r| temporary.
    resid = torch.softmax(target_logits, dim=-1, dtype=acc).sub_(probs)
    tv = torch.linalg.vector_norm(resid, 1, dim=-1)
    c = (1.0 - 0.5 * tv).clamp(0.0, 1.0) * valid
    w = dpace_weights(valid, c) if dpace else base_weights.to(acc)
    if not with_grad:
        return ce, tv, kl, c, w, None
    # d KL / dlogits = p_d - p_t = -r
    kl_grad = resid * (-kl_weight * w).unsqueeze(-1) if kl_weight else None
    # d/dlogits: CE -> w (p - onehot); L1 -> w p (s - <s, p>) with s = sign(p_d - p_t) = -sign(r),
    # so grad = p * (ce_w w + a (<sign r, p> - sign r)) - ce_w w onehot, with a = tv_w w.
    sign = resid.sign_()
    a = tv_weight * w
    b = ce_weight * w + a * torch.linalg.vecdot(sign, probs)
    grad = torch.addcmul(b.unsqueeze(-1), sign, -a.unsqueeze(-1)).mul_(probs)
    grad.scatter_add_(-1, labels.unsqueeze(-1), (-ce_weight * w).unsqueeze(-1))
    if kl_grad is not None:
        grad.add_(kl_grad)
    return ce, tv, kl, c, w, grad.to(logits.dtype)


_COMPILED_CHUNK_TERMS = None
_COMPILE_FAILED: str | None = None
_KERNEL_THAT_RAN = None  # the compiled kernel once a call of it succeeded: compiling is over


def compiled_chunk_terms():
    """:func:`chunk_terms` through ``torch.compile`` (built once per process, static shapes:
    the caller pads the last chunk). CPU needs a C++ compiler; the first call compiles
    for some seconds."""
    global _COMPILED_CHUNK_TERMS
    if _COMPILED_CHUNK_TERMS is None:
        _COMPILED_CHUNK_TERMS = torch.compile(chunk_terms, dynamic=False)
    return _COMPILED_CHUNK_TERMS


def _chunk_terms_compiled_or_eager(*args):
    """The compiled kernel; if compiling fails (no C++ compiler, an unsupported backend), say
    why once and run eagerly for the rest of the process: same results, only slower.

    Only failures before the kernel's first successful call (the one that compiles) fall
    back, and only when the eager kernel then succeeds on the same inputs: an error that
    eager mode raises too (a label past the vocabulary) is the inputs', and propagates as
    eager mode raises it, without blaming the compiler. An error of a kernel that has
    already run, and an out-of-memory error at any call, belong to the run and propagate:
    eager mode would not cure them."""
    global _COMPILE_FAILED, _KERNEL_THAT_RAN
    if _COMPILE_FAILED is None:
        kernel = compiled_chunk_terms()
        if kernel is _KERNEL_THAT_RAN:
            return kernel(*args)
        try:
            out = kernel(*args)
            _KERNEL_THAT_RAN = kernel
            return out
        except Exception as exc:  # noqa: BLE001 - inductor raises many types; eager is always right
            if _out_of_memory(exc):
                raise
            failure = exc
        # outside the handler: an error of the inputs' own propagates alone, as eager raises it
        out = chunk_terms(*args)
        first = (str(failure).strip().splitlines() or [type(failure).__name__])[0]
        _COMPILE_FAILED = f"{type(failure).__name__}: {first}"
        print(f"train.loss.compile: torch.compile of the objective failed ({_COMPILE_FAILED[:300]}); "
              "running it eagerly (same results, slower). Set train.loss.compile: false to skip "
              "the attempt.", file=sys.stderr, flush=True)
        return out
    return chunk_terms(*args)


def _out_of_memory(exc: BaseException) -> bool:
    """An out-of-memory error, raised directly or wrapped (inductor wraps errors of the compile)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _chunked_vocab_sums(hidden, latent, markov_w2, lm_head, target_hidden, labels, valid,
                        base_weights, ce_weight: float, tv_weight: float, chunk_blocks: int,
                        dpace: bool, compiled: bool, kl_weight: float, with_grad: bool):
    """The chunk loop of :class:`_FusedVocabLoss`: ``(total, sum w*CE, sum w*TV, sum w*KL, c*,
    w, (d total/d hidden, d/d latent, d/d W2 in fp32))``; the gradients are None when not
    ``with_grad`` (no grad wanted: half the vocabulary-sized matmuls and no buffers)."""
    num_blocks, block_size, _ = hidden.shape
    dtype = lm_head.dtype
    acc = accumulation_dtype(dtype)
    grad_hidden = grad_latent = grad_w2 = None
    if with_grad:
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        grad_latent = None if latent is None else torch.empty_like(latent)
        if latent is not None:
            w2_sum = _W2GradientSum(markov_w2, dtype, acc, chunk_blocks * block_size,
                                    num_blocks * block_size)
    # One matmul for both logit terms: [h, latent] @ [lm_head, W2]^T. A single
    # vocabulary-sized product (and conversion) instead of two, in both directions.
    head = lm_head if latent is None else _vocab_head(lm_head, markov_w2)
    width = hidden.shape[-1]
    terms = _chunk_terms_compiled_or_eager if compiled else chunk_terms
    c_star = torch.zeros(num_blocks, block_size, dtype=acc, device=hidden.device)
    weights = torch.zeros_like(c_star)
    sum_ce = torch.zeros((), dtype=acc, device=hidden.device)
    sum_tv = torch.zeros_like(sum_ce)
    sum_kl = torch.zeros_like(sum_ce)
    for start in range(0, num_blocks, chunk_blocks):
        sl = slice(start, min(start + chunk_blocks, num_blocks))
        h = hidden[sl].to(dtype)
        if latent is not None:
            lat = latent[sl].to(dtype)
            h = torch.cat([h, lat], dim=-1)
        th, lab, val, base = target_hidden[sl].to(dtype), labels[sl], valid[sl], base_weights[sl]
        rows = h.shape[0]
        if compiled and rows < chunk_blocks:  # one shape for the compiled kernel: pad with invalid rows
            h, th, lab, val, base = (_pad_rows(x, chunk_blocks) for x in (h, th, lab, val, base))
        ce, tv, kl, c, w, grad = terms(h @ head.t(), _target_logits(th, lm_head), lab, val, base,
                                       ce_weight, tv_weight, dpace, kl_weight, with_grad)
        if rows < h.shape[0]:
            ce, tv, kl, c, w = (x[:rows] for x in (ce, tv, kl, c, w))
            grad = None if grad is None else grad[:rows]
        c_star[sl], weights[sl] = c, w
        sum_ce += (w * ce).sum()
        sum_tv += (w * tv).sum()
        sum_kl += (w * kl).sum()
        if not with_grad:
            continue
        grad_in = grad @ head  # [rows, H (+ r)]: both input gradients in one product
        grad_hidden[sl] = grad_in[..., :width].to(hidden.dtype)
        if latent is not None:
            grad_latent[sl] = grad_in[..., width:].to(latent.dtype)
            w2_sum.add(grad.flatten(0, 1), lat.flatten(0, 1))
        del grad, grad_in
    if with_grad and latent is not None:
        grad_w2 = w2_sum.total()
    total = ce_weight * sum_ce + tv_weight * sum_tv + kl_weight * sum_kl
    return total, sum_ce, sum_tv, sum_kl, c_star, weights, (grad_hidden, grad_latent, grad_w2)


#: on a CPU, bytes of chunk gradients gathered before W2's gradient is multiplied out
#: (:class:`_W2GradientSum`)
W2_GROUP_BYTES = 256 << 20


def w2_group_rows(vocab: int, element_bytes: int, *, chunk_rows: int, total_rows: int, on_cpu: bool) -> int:
    """Rows of the buffer that :class:`_W2GradientSum` gathers chunks in, 0 for none (a GPU, or
    a group that would hold a single chunk): whole chunks, up to ``W2_GROUP_BYTES`` of
    gradient, no more than the call's ``total_rows``. The dry run's estimate counts it too."""
    if not on_cpu:
        return 0
    rows = min(max(chunk_rows, W2_GROUP_BYTES // (vocab * element_bytes) // chunk_rows * chunk_rows),
               total_rows)
    return rows if rows > chunk_rows else 0


_GROUP_BUFFERS: dict = {}


def w2_group_buffers(rows: int, vocab: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`_W2GradientSum`'s CPU buffers (their first ``rows`` rows), kept for later calls:
    a fresh buffer above glibc's mmap threshold is new pages that fault on first touch
    (filling a 768 x 49,152 bf16 buffer took 45 ms fresh against 14 ms reused, one thread).
    Micro-batches differ in rows, so the buffer is replaced only by a larger one or another
    shape: it holds the most rows a call has needed (the dry run counts it as held)."""
    key = (vocab, rank, dtype)
    held = _GROUP_BUFFERS.get("buffers")
    if _GROUP_BUFFERS.get("key") != key or held[0].shape[0] < rows:
        _GROUP_BUFFERS.clear()  # the old buffers go before the new ones are allocated
        _GROUP_BUFFERS.update(key=key, buffers=(torch.empty(rows, vocab, dtype=dtype),
                                                torch.empty(rows, rank, dtype=dtype)))
    grads, latents = _GROUP_BUFFERS["buffers"]
    return grads[:rows], latents[:rows]


class _W2GradientSum:
    """W2's gradient, the sum over chunks of ``grad^T @ latent``, multiplied out per group of chunks.

    Each chunk's product is a ``[V, r]`` matrix. On a CPU, converting it to fp32 and adding
    it, chunk by chunk, took about three times as long as the product itself (V = 49,152,
    r = 256, 64 rows a chunk, one thread: 11 ms for the product, 35 ms for the conversion and
    the addition, which stream 125 MB through memory). So there the chunks' gradient and latent
    rows are copied into one buffer of up to ``W2_GROUP_BYTES`` (kept between calls) and multiplied in one product
    over all of them: one conversion and addition per group, and the product rounded to the
    logits' dtype once per group instead of once per chunk (the matmul accumulates its whole
    inner dimension in fp32). On a GPU, where that addition is a small part of a chunk, each
    chunk is its own group and the objective holds no buffer."""

    def __init__(self, markov_w2: torch.Tensor, dtype: torch.dtype, sum_dtype: torch.dtype,
                 chunk_rows: int, total_rows: int):
        vocab, rank = markov_w2.shape
        self.sum_dtype = sum_dtype
        self.sum = torch.zeros_like(markov_w2, dtype=sum_dtype) if total_rows == 0 else None
        rows = w2_group_rows(vocab, torch.empty((), dtype=dtype).element_size(), chunk_rows=chunk_rows,
                             total_rows=total_rows, on_cpu=markov_w2.device.type == "cpu")
        self.grads = self.latents = None
        if rows:
            self.grads, self.latents = w2_group_buffers(rows, vocab, rank, dtype)
        self.filled = 0

    def add(self, grad: torch.Tensor, latent: torch.Tensor) -> None:
        """One chunk's ``[rows, V]`` gradient of the logits and its ``[rows, r]`` latents."""
        if self.grads is None:
            self._accumulate(grad.t() @ latent)
            return
        if self.filled + grad.shape[0] > self.grads.shape[0]:
            self._flush()
        end = self.filled + grad.shape[0]
        self.grads[self.filled:end].copy_(grad)
        self.latents[self.filled:end].copy_(latent)
        self.filled = end

    def _accumulate(self, product: torch.Tensor) -> None:
        self.sum = product.to(self.sum_dtype) if self.sum is None else self.sum.add_(product)

    def _flush(self) -> None:
        if self.filled:
            self._accumulate(self.grads[:self.filled].t() @ self.latents[:self.filled])
            self.filled = 0

    def total(self) -> torch.Tensor:
        """The whole sum, in the sum's dtype."""
        if self.grads is not None:
            self._flush()
            self.grads = self.latents = None
        return self.sum


class _FusedVocabLoss(torch.autograd.Function):
    """Chunked CE + TV (+ KL) over the vocabulary with gradients computed in the forward pass.

    Returns ``(ce_weight * sum w*CE + tv_weight * sum w*TV + kl_weight * sum w*KL, sum w*CE,
    sum w*TV, sum w*KL, c*, w)``; only the first output carries a gradient.
    """

    @staticmethod
    def forward(ctx, hidden, latent, markov_w2, *args):
        *sums, grads = _chunked_vocab_sums(hidden, latent, markov_w2, *args, with_grad=True)
        ctx.save_for_backward(*grads)
        ctx.has_latent = latent is not None
        ctx.w2_dtype = None if markov_w2 is None else markov_w2.dtype
        ctx.mark_non_differentiable(*sums[1:])
        return tuple(sums)

    @staticmethod
    def backward(ctx, grad_total, *unused):
        grad_hidden, grad_latent, grad_w2 = ctx.saved_tensors
        # In fp32, rounded once: a bf16 copy of the scale (loss scale / denominator) would be
        # off by up to 0.4 % for the whole backbone's gradient.
        scale = grad_total.to(accumulation_dtype(grad_total.dtype))
        out_hidden = (grad_hidden.to(scale.dtype) * scale).to(grad_hidden.dtype)
        out_latent = out_w2 = None
        if ctx.has_latent:
            out_latent = (grad_latent.to(scale.dtype) * scale).to(grad_latent.dtype)
            out_w2 = (grad_w2 * scale).to(ctx.w2_dtype)
        return (out_hidden, out_latent, out_w2) + (None,) * 11


def _rebuilt(cache: dict, lm_head: torch.Tensor, key: tuple) -> bool:
    """Whether ``cache`` must be filled again: it was built for another tensor (a weak
    reference, so a new draft at a recycled address is not the same one) or under another
    ``key``. Then it is emptied first (the old copy goes before a new one is made) and holds
    only the new owner and key, for the caller to fill."""
    owner = cache.get("owner")
    if owner is not None and owner() is lm_head and cache.get("key") == key:
        return False
    cache.clear()
    cache.update(owner=weakref.ref(lm_head), key=key)
    return True


_HEAD_CACHE: dict = {}


def _vocab_head(lm_head: torch.Tensor, markov_w2: torch.Tensor) -> torch.Tensor:
    """``[lm_head, W2]`` as one ``[V, H + r]`` matrix. ``lm_head`` is frozen, so on CPU its
    columns are copied once and only W2's are refreshed per call. The copy is reused only for
    the very same tensor (a weak reference: a new draft at a recycled address is not it) at
    the same in-place version and storage (``param.data = other`` keeps the version); elsewhere,
    and whenever one of those changes, it is rebuilt."""
    if lm_head.is_cuda:  # a fresh cat is cheap there, and a cached copy would hold memory
        return torch.cat([lm_head, markov_w2.to(lm_head.dtype)], dim=1)
    key = (lm_head._version, lm_head.data_ptr(), tuple(lm_head.shape), lm_head.dtype, tuple(markov_w2.shape),
           markov_w2.dtype)
    if _rebuilt(_HEAD_CACHE, lm_head, key):
        _HEAD_CACHE["head"] = torch.cat([lm_head, markov_w2.to(lm_head.dtype)], dim=1)
    else:  # copy_ rounds as .to(lm_head.dtype) does, without the separate converted copy
        _HEAD_CACHE["head"][:, lm_head.shape[1]:].copy_(markov_w2)
    return _HEAD_CACHE["head"]


_PACKED_CACHE: dict = {}


def _target_logits(target_hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """``target_hidden @ lm_head^T``. On a CPU in bf16 the frozen ``lm_head`` is reordered once
    into oneDNN's blocked layout (``splitserve/packed_linear.py``), where a plain matmul
    reorders it on every call: at the CPU recipe's chunk of 64 rows about twice as fast. The
    packed product is used for a row count only after it gave the plain product's exact bits
    for that row count (checked on the first chunk of that size). The packed copy is kept for
    the very same tensor at the same version and storage, as :func:`_vocab_head`'s copy."""
    from draftforge.splitserve.packed_linear import packed_copy, packed_product

    if lm_head.device.type != "cpu" or lm_head.dtype != torch.bfloat16:
        return target_hidden @ lm_head.t()
    key = (lm_head._version, lm_head.data_ptr(), tuple(lm_head.shape))
    if _rebuilt(_PACKED_CACHE, lm_head, key):
        _PACKED_CACHE.update(packed=packed_copy(lm_head), exact={})
    packed, exact = _PACKED_CACHE["packed"], _PACKED_CACHE["exact"]
    rows = target_hidden.numel() // target_hidden.shape[-1]
    if packed is None or not target_hidden.is_contiguous() or exact.get(rows) is False:
        return target_hidden @ lm_head.t()
    if rows in exact:
        return packed_product(target_hidden, packed)
    plain = target_hidden @ lm_head.t()
    if plain.isfinite().all():  # a verdict from finite values only (NaN equals nothing)
        try:
            exact[rows] = torch.equal(packed_product(target_hidden, packed), plain)
        except RuntimeError:  # the op refused these inputs: the plain product from now on
            exact[rows] = False
    return plain


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    pad = x.new_zeros((rows - x.shape[0], *x.shape[1:]))
    return torch.cat([x, pad])


def vocab_terms(
    hidden, latent, markov_w2, lm_head, target_hidden, labels, valid, base_weights, *,
    ce_weight: float, tv_weight: float, chunk_blocks: int, dpace: bool, compiled: bool = False,
    kl_weight: float = 0.0,
):
    """CE/TV/KL sums over all blocks, chunked; see :class:`_FusedVocabLoss`. Without a
    gradient to compute (``torch.no_grad()``, or no input that requires one) the sums only."""
    args = (lm_head, target_hidden, labels, valid.float(), base_weights, float(ce_weight),
            float(tv_weight), int(chunk_blocks), bool(dpace), bool(compiled), float(kl_weight))
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, latent, markov_w2)):
        return _FusedVocabLoss.apply(hidden, latent, markov_w2, *args)
    return _chunked_vocab_sums(hidden, latent, markov_w2, *args, with_grad=False)[:6]


def vocab_terms_unchunked(
    hidden, latent, markov_w2, lm_head, target_hidden, labels, valid, base_weights, *,
    ce_weight: float, tv_weight: float, dpace: bool, kl_weight: float = 0.0, **_unused,
):  # chunk_blocks and compiled do not apply
    """The same sums through plain autograd on all blocks at once (memory baseline)."""
    logits = hidden.to(lm_head.dtype) @ lm_head.t()
    if latent is not None:
        logits = logits + latent.to(lm_head.dtype) @ markov_w2.t()
    acc = accumulation_dtype(logits.dtype)
    logp = torch.log_softmax(logits.to(acc), dim=-1)
    with torch.no_grad():
        target_logp = torch.log_softmax((target_hidden.to(lm_head.dtype) @ lm_head.t()).to(acc), dim=-1)
        target = target_logp.exp()
    ce = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    tv = (logp.exp() - target).abs().sum(-1)
    kl = (target * (target_logp - logp)).sum(-1)
    c_star = ((1.0 - 0.5 * tv.detach()).clamp(0.0, 1.0)) * valid.to(acc)
    weights = dpace_weights(valid, c_star) if dpace else base_weights.to(acc)
    sum_ce, sum_tv, sum_kl = (weights * ce).sum(), (weights * tv).sum(), (weights * kl).sum()
    total = ce_weight * sum_ce + tv_weight * sum_tv + kl_weight * sum_kl
    return total, sum_ce.detach(), sum_tv.detach(), sum_kl.detach(), c_star, weights


def dspark_objective(
    model,
    hidden: torch.Tensor,
    prev_tokens: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    target_hidden: torch.Tensor,
    *,
    ce_weight: float = 0.1,
    tv_weight: float = 0.9,
    bce_weight: float = 1.0,
    kl_weight: float = 0.0,
    decay: float = 4.0,
    position_weighting: str = "exp",
    chunk_blocks: int = 64,
    chunked: bool = True,
    compile: bool | str = "auto",
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    denominator: torch.Tensor | None = None,
) -> ObjectiveOutput:
    """The loss of N blocks.

    hidden [N, γ, H] (post-norm draft states), prev_tokens / labels / valid [N, γ],
    target_hidden [N, γ, H_t] (the target's final post-norm state at p + k).
    ``reduce_sum`` sums the weight denominator over ranks (identity by default).
    ``denominator``: the weight sum to divide by, when the caller knows it before the
    forward (the trainer: exp weights summed over every micro-batch of an optimizer step
    and every rank, so that accumulation weighs each block alike); it replaces
    ``reduce_sum``.
    ``compile``: run the chunks' elementwise vocabulary work through ``torch.compile``
    (``"auto"``: on CUDA only; on CPU it needs a C++ compiler and pays off on long runs).
    """
    if position_weighting not in ("exp", "dpace"):
        raise ValueError(f"position_weighting {position_weighting!r} is not one of 'exp', 'dpace'")
    valid = valid.bool()
    latent = emb = None
    markov_w2 = None
    if model.markov_head is not None:
        latent, emb = model.markov_head.teacher_forced(prev_tokens, hidden)
        markov_w2 = model.markov_head.markov_w2.weight
    terms = vocab_terms if chunked else vocab_terms_unchunked
    acc = accumulation_dtype(model.lm_head.weight.dtype)
    total, sum_ce, sum_tv, sum_kl, c_star, weights = terms(
        hidden, latent, markov_w2, model.lm_head.weight, target_hidden, labels, valid,
        exp_weights(valid, decay, acc), ce_weight=ce_weight, tv_weight=tv_weight, kl_weight=kl_weight,
        chunk_blocks=chunk_blocks, dpace=position_weighting == "dpace",
        compiled=hidden.is_cuda if compile == "auto" else bool(compile),
    )
    sum_bce = torch.zeros((), dtype=acc, device=hidden.device)
    if model.confidence_head is not None:
        z = model.confidence_head(hidden, emb).to(acc)
        bce = F.binary_cross_entropy_with_logits(z, c_star, reduction="none")
        sum_bce = (weights * bce).sum()
    if denominator is None:
        denominator = weights.sum()
        if reduce_sum is not None:
            denominator = reduce_sum(denominator.detach().clone())
    denominator = denominator.clamp(min=1e-6)
    loss = (total + bce_weight * sum_bce) / denominator
    return ObjectiveOutput(
        loss=loss,
        ce=(sum_ce / denominator).detach(),
        tv=(sum_tv / denominator).detach(),
        kl=(sum_kl / denominator).detach(),
        bce=(sum_bce / denominator).detach(),
        c_star=c_star,
        weights=weights,
        valid=valid,
    )
