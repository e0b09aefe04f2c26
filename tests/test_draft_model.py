"""The DSpark draft: packed training forward against per-block inference, Markov heads, gradients."""

from __future__ import annotations

import pytest
import torch
from dspark_helpers import random_batch, tiny_config, tiny_draft

from draftforge.train.blocks import build_layout, dense_block_mask, sample_anchors
from draftforge.train.model import DSparkConfig, DSparkDraft, count_parameters


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_packed_forward_equals_per_block_inference(kv_heads):
    model = tiny_draft(num_key_value_heads=kv_heads).eval()
    cfg = model.config
    input_ids, loss_mask, aux, _ = random_batch(cfg)
    anchors, valid = sample_anchors(loss_mask, num_anchors=9, generator=torch.Generator().manual_seed(3))
    layout = build_layout(input_ids, loss_mask, anchors, valid, cfg.block_size)
    with torch.no_grad():
        packed = model.packed_hidden(input_ids, aux, layout)
        checked = 0
        for b in range(input_ids.shape[0]):
            for a in range(anchors.shape[1]):
                p = int(anchors[b, a])
                if not valid[b, a]:
                    continue
                # Inference sees only the context strictly before the anchor.
                single = model.block_forward(input_ids[b : b + 1, p], p, aux[b : b + 1, :p])
                torch.testing.assert_close(packed[b, a], single[0], rtol=1e-5, atol=1e-5)
                checked += 1
    assert checked >= 12


def test_block_sees_no_context_at_or_after_anchor():
    model = tiny_draft().eval()
    cfg = model.config
    input_ids, loss_mask, aux, _ = random_batch(cfg, batch=1)
    anchors = torch.tensor([[10, 20]])
    valid = torch.tensor([[True, True]])
    layout = build_layout(input_ids, loss_mask, anchors, valid, cfg.block_size)
    with torch.no_grad():
        before = model.packed_hidden(input_ids, aux, layout)
        at_and_after = aux.clone()
        at_and_after[:, 20:] += 5.0  # features at and after the second anchor
        after = model.packed_hidden(input_ids, at_and_after, layout)
        middle = aux.clone()
        middle[:, 15] += 5.0  # seen by the block at 20, not by the block at 10
        after_middle = model.packed_hidden(input_ids, middle, layout)
    torch.testing.assert_close(before, after)
    torch.testing.assert_close(before[0, 0], after_middle[0, 0])
    assert not torch.allclose(before[0, 1], after_middle[0, 1])


def test_dense_mask_by_hand():
    mask = dense_block_mask(torch.tensor([[2, 5]]), seq_len=6, block_size=2)
    expected = torch.tensor(
        [
            # ctx 0..5            block0  block1
            [1, 1, 0, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 0, 0, 0, 1, 1],
            [1, 1, 1, 1, 1, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0], expected)


def test_layout_labels_and_cumulative_validity():
    input_ids = torch.arange(10).unsqueeze(0) + 100
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1, 1, 1]], dtype=torch.bool)
    layout = build_layout(input_ids, loss_mask, torch.tensor([[3, 0]]), torch.tensor([[True, False]]), 4)
    assert layout.positions.tolist() == [[[3, 4, 5, 6], [0, 1, 2, 3]]]
    assert layout.labels[0, 0].tolist() == [104, 105, 106, 107]
    assert layout.prev_tokens[0, 0].tolist() == [103, 104, 105, 106]
    # label 106 is not supervised, so slot 2 and every later slot are invalid.
    assert layout.valid[0, 0].tolist() == [True, True, False, False]
    assert not layout.valid[0, 1].any()  # dummy block


def test_anchor_sampling_supervises_anchor_and_next_token_and_pads():
    loss_mask = torch.zeros(2, 30, dtype=torch.bool)
    loss_mask[0, 10:] = True
    loss_mask[1, 25:28] = True  # only anchors 25, 26 qualify
    gen = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(loss_mask, num_anchors=6, generator=gen)
    assert valid[0].all() and anchors[0].tolist() == sorted(set(anchors[0].tolist()))
    assert all(10 <= p <= 28 for p in anchors[0].tolist())
    assert anchors[1, :2].tolist() == [25, 26] and valid[1].tolist() == [True] * 2 + [False] * 4
    again, _ = sample_anchors(loss_mask, 6, generator=torch.Generator().manual_seed(0))
    other, _ = sample_anchors(loss_mask, 6, generator=torch.Generator().manual_seed(1))
    assert torch.equal(again, anchors) and not torch.equal(other[0], anchors[0])


def test_anchor_sampling_runs_no_block_that_only_pads():
    """When no sequence has num_anchors candidates, the width is the most any has (hand
    counted), so a batch of short samples does not run num_anchors blocks a sequence."""
    loss_mask = torch.zeros(3, 40, dtype=torch.bool)
    loss_mask[0, 5:10] = True  # anchors 5..8: 4 candidates
    loss_mask[1, 20:27] = True  # anchors 20..25: 6 candidates
    loss_mask[2, 0:2] = True  # anchor 0: 1 candidate
    anchors, valid = sample_anchors(loss_mask, 512, generator=torch.Generator().manual_seed(0))
    assert anchors.shape == valid.shape == (3, 6)
    assert anchors[0, :4].tolist() == [5, 6, 7, 8] and valid.sum(dim=1).tolist() == [4, 6, 1]
    assert anchors[1].tolist() == [20, 21, 22, 23, 24, 25] and anchors[2, 0].item() == 0
    # a batch without any candidate keeps one dummy column; more candidates than asked cap it
    none, none_valid = sample_anchors(torch.zeros(2, 8, dtype=torch.bool), 16)
    assert none.shape == (2, 1) and not none_valid.any()
    capped, _ = sample_anchors(loss_mask, 3, generator=torch.Generator().manual_seed(0))
    assert capped.shape == (3, 3)


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_markov_teacher_forced_equals_sequential_loop(head_type):
    model = tiny_draft(markov_head_type=head_type).eval()
    cfg = model.config
    torch.manual_seed(4)
    hidden = torch.randn(3, cfg.block_size, cfg.hidden_size)
    anchor = torch.randint(0, cfg.vocab_size, (3,))
    labels = torch.randint(0, cfg.vocab_size, (3, cfg.block_size))
    prev = torch.cat([anchor[:, None], labels[:, :-1]], dim=1)
    with torch.no_grad():
        latent, emb = model.markov_head.teacher_forced(prev, hidden)
        forced = model.lm_head(hidden) + model.markov_head.markov_w2(latent)
        forced_conf = model.confidence_head(hidden, emb)
        # The inference loop, made to "draft" exactly the labels.
        tokens, loop_logits, loop_conf = model.draft_block(hidden, anchor, sample=lambda lg, k: labels[:, k])
    assert torch.equal(tokens, labels)
    torch.testing.assert_close(loop_logits, forced, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loop_conf, forced_conf, rtol=1e-5, atol=1e-5)


def test_greedy_draft_uses_its_own_tokens():
    model = tiny_draft(markov_head_type="vanilla").eval()
    cfg = model.config
    hidden = torch.randn(2, cfg.block_size, cfg.hidden_size)
    anchor = torch.tensor([1, 2])
    with torch.no_grad():
        tokens, logits, _ = model.draft_block(hidden, anchor)
        w1, w2 = model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight
        prev = anchor
        for k in range(cfg.block_size):
            expected = model.lm_head.weight @ hidden[:, k].T  # [V, B]
            expected = expected.T + w1[prev] @ w2.T
            torch.testing.assert_close(logits[:, k], expected, rtol=1e-5, atol=1e-5)
            prev = expected.argmax(-1)
            assert torch.equal(tokens[:, k], prev)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"markov_head_type": "gated"},
        {"markov_head_type": "rnn", "confidence_head_with_markov": False},
        {"markov_rank": 0, "enable_confidence_head": False, "confidence_head_with_markov": False},
    ],
    ids=["dspark", "gated", "rnn-conf-no-markov", "dflash"],
)
def test_gradients_reach_exactly_the_trainable_parameters(overrides):
    model = tiny_draft(**overrides)
    cfg = model.config
    input_ids, loss_mask, aux, final = random_batch(cfg)
    anchors, valid = sample_anchors(loss_mask, 6, generator=torch.Generator().manual_seed(0))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert set(frozen) == {"embed_tokens.weight", "lm_head.weight"}
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        out = model(input_ids, loss_mask, aux, final, anchors, valid, objective={"chunk_blocks": 5})
        out.loss.backward()
        for name, param in model.named_parameters():
            if name in frozen:
                assert param.grad is None, name
            else:
                assert param.grad is not None and param.grad.abs().sum() > 0, name
        optimizer.step()
    for name, param in model.named_parameters():
        if name in frozen:
            assert torch.equal(param, frozen[name]), f"{name} changed"
    if cfg.markov_rank == 0:
        assert model.markov_head is None and model.confidence_head is None


def test_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="does not divide into"):
        tiny_config(hidden_size=30, target_hidden_size=30)
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads"):
        tiny_config(num_key_value_heads=3)
    with pytest.raises(ValueError, match="final layer is not allowed"):
        tiny_config(target_layer_ids=[0, 5])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_config(mask_token_id=64)
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        tiny_config(block_size=1)
    with pytest.raises(ValueError, match="must equal the target's hidden size"):
        tiny_config(target_hidden_size=48)


def test_ling_parameter_count_matches_published():
    cfg = DSparkConfig(
        vocab_size=157184, hidden_size=2560, num_hidden_layers=5, num_attention_heads=32,
        num_key_value_heads=32, head_dim=128, intermediate_size=6144, target_hidden_size=2560,
        num_target_layers=42, target_layer_ids=[1, 11, 23, 29, 35], block_size=8, mask_token_id=0,
        markov_rank=256, enable_confidence_head=True, confidence_head_with_markov=True,
    )
    with torch.device("meta"):
        model = DSparkDraft.__new__(DSparkDraft)
        torch.nn.Module.__init__(model)
        model.config = cfg
        # Build the submodules without init_weights (meta tensors hold no data).
        model.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        model.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        from draftforge.train.model import ConfidenceHead, DecoderLayer, MarkovHead, RMSNorm

        model.fc = torch.nn.Linear(cfg.num_context_features, cfg.hidden_size, bias=False)
        model.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        model.layers = torch.nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        model.markov_head = MarkovHead(cfg)
        model.confidence_head = ConfidenceHead(cfg)
    assert count_parameters(model, with_embeddings=True) == 1_363_707_905


def test_flex_attention_agrees_with_sdpa_in_forward():
    pytest.importorskip("torch.nn.attention.flex_attention")
    sdpa_model = tiny_draft().eval()
    flex_model = tiny_draft(attention_backend="flex").eval()
    flex_model.load_state_dict(sdpa_model.state_dict())
    cfg = sdpa_model.config
    input_ids, loss_mask, aux, _ = random_batch(cfg, seq_len=64)
    anchors, valid = sample_anchors(loss_mask, 8, generator=torch.Generator().manual_seed(0))
    layout = build_layout(input_ids, loss_mask, anchors, valid, cfg.block_size)
    with torch.no_grad():
        expected = sdpa_model.packed_hidden(input_ids, aux, layout)
        actual = flex_model.packed_hidden(input_ids, aux, layout)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_flex_attention_training_on_cpu_is_refused_naming_the_setting():
    pytest.importorskip("torch.nn.attention.flex_attention")
    from draftforge.errors import InputError

    model = tiny_draft(attention_backend="flex")
    input_ids, loss_mask, aux, final = random_batch(model.config)
    anchors, valid = sample_anchors(loss_mask, 6, generator=torch.Generator().manual_seed(0))
    with pytest.raises(InputError, match=r"draft\.attention_backend: flex cannot train on CPU.*"
                       r"draft\.attention_backend: sdpa"):
        model(input_ids, loss_mask, aux, final, anchors, valid)
    with torch.no_grad():  # forward only (eval) still runs
        assert torch.isfinite(model(input_ids, loss_mask, aux, final, anchors, valid).loss)


def _contract_block_hidden(sd: dict, cfg, anchor: int, p: int, aux: torch.Tensor, *,
                           norm_ctx_again: bool = False) -> torch.Tensor:
    """The draft's post-norm block states written out from the contract (dspark-contract.md,
    section 1), in float64, from the state dict alone: ctx = hidden_norm(fc(aux)); Qwen3
    layers whose keys and values are [ctx; block] (ctx not normed again), keys per-head
    k_norm'd, RoPE (rotate-half) at absolute positions, queries from the block only, which
    sees every context position and all of its own slots; SwiGLU MLP; final norm.
    ``norm_ctx_again``: a plausible mistake (ctx through each layer's input norm too), for the
    test to show it would notice one."""
    d = {k: v.double() for k, v in sd.items()}
    eps, hd = cfg.rms_norm_eps, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w

    def rope(x, positions):  # x [heads, n, hd]
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = positions.double()[:, None] * inv[None]
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        rotated = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
        return x * cos + rotated * sin

    def heads(x, n):  # [L, n*hd] -> [n, L, hd]
        return x.view(x.shape[0], n, hd).transpose(0, 1)

    ctx = rms(aux[0, :p].double() @ d["fc.weight"].T, d["hidden_norm.weight"])
    tokens = [anchor] + [cfg.mask_token_id] * (cfg.block_size - 1)
    x = d["embed_tokens.weight"][tokens]
    ctx_pos, block_pos = torch.arange(p), torch.arange(p, p + cfg.block_size)
    for i in range(cfg.num_hidden_layers):
        w = lambda name, i=i: d[f"layers.{i}.{name}"]  # noqa: E731
        h = rms(x, w("input_layernorm.weight"))
        c = rms(ctx, w("input_layernorm.weight")) if norm_ctx_again else ctx
        q = rope(rms(heads(h @ w("self_attn.q_proj.weight").T, nh), w("self_attn.q_norm.weight")), block_pos)
        k_ctx = rope(rms(heads(c @ w("self_attn.k_proj.weight").T, nkv), w("self_attn.k_norm.weight")), ctx_pos)
        k_blk = rope(rms(heads(h @ w("self_attn.k_proj.weight").T, nkv), w("self_attn.k_norm.weight")), block_pos)
        k = torch.cat([k_ctx, k_blk], 1).repeat_interleave(nh // nkv, 0)
        v = torch.cat([heads(c @ w("self_attn.v_proj.weight").T, nkv),
                       heads(h @ w("self_attn.v_proj.weight").T, nkv)], 1).repeat_interleave(nh // nkv, 0)
        attn = torch.softmax(q @ k.transpose(1, 2) / hd**0.5, -1) @ v  # [nh, L, hd]
        x = x + attn.transpose(0, 1).reshape(len(tokens), nh * hd) @ w("self_attn.o_proj.weight").T
        h = rms(x, w("post_attention_layernorm.weight"))
        gate, up = h @ w("mlp.gate_proj.weight").T, h @ w("mlp.up_proj.weight").T
        x = x + (torch.nn.functional.silu(gate) * up) @ w("mlp.down_proj.weight").T
    return rms(x, d["norm.weight"])


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_the_backbone_is_the_contracts_layer_stack_written_out_by_hand(kv_heads):
    """The packed and per-block paths are compared with each other elsewhere; this compares
    the stack itself (norms, per-head q/k norms, RoPE, GQA, KV injection, SwiGLU) with an
    independent float64 rendering of the contract, so a convention error SGLang or llama.cpp
    would not share cannot hide in code both paths use."""
    torch.manual_seed(0)
    model = tiny_draft(num_key_value_heads=kv_heads).double()
    with torch.no_grad():  # norms away from 1, so that a norm applied or skipped shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.5 * torch.randn_like(param))
    cfg = model.config
    aux = torch.randn(1, 20, cfg.num_context_features, dtype=torch.float64)
    for anchor, p in ((7, 1), (11, 13), (3, 19)):
        got = model.block_forward(torch.tensor([anchor]), p, aux[:, :p])[0]
        expected = _contract_block_hidden(model.state_dict(), cfg, anchor, p, aux)
        # the norms and RoPE tables run in float32 by design (as Qwen3's do): float32 agreement
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        mistaken = _contract_block_hidden(model.state_dict(), cfg, anchor, p, aux, norm_ctx_again=True)
        assert (mistaken - expected).abs().max() > 1e-3  # 100 times the tolerance
