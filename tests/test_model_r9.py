"""Round 9 of the draft model's review: the inference path's input guards, RoPE's head_dim,
and the training forward against per-block inference at the very start of a sequence."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from dspark_helpers import random_batch, tiny_config, tiny_draft

from draftforge.train.blocks import build_layout
from draftforge.train.export import ExportError
from draftforge.train.hf_load import config_from_serving
from draftforge.train.model import ContextCache


def test_a_block_whose_aux_is_shorter_than_its_anchor_is_refused_and_the_cache_keeps_nothing():
    """aux sliced short used to run: the block saw positions 0..7 instead of 0..11, and the
    cache recorded 12 positions while holding 8, so every later block lacked 8..11 too."""
    model = tiny_draft().eval()
    aux = torch.randn(1, 20, model.config.num_context_features, generator=torch.Generator().manual_seed(0))
    anchor = torch.tensor([3])
    cache = ContextCache()
    with torch.no_grad():
        for kept in (cache, None):
            with pytest.raises(ValueError, match=r"^the block at anchor position 12 sees the context "
                                                 r"positions 0 \.\. 11, but aux holds only 8 positions$"):
                model.block_forward(anchor, 12, aux[:, :8], cache=kept)
        assert cache.length == 0 and cache.kv == []
        with pytest.raises(ValueError, match=r"^anchor position must be >= 0, got -1$"):
            model.block_forward(anchor, -1, aux)
        # the same cache then serves the whole context exactly; a block at 0 needs no context
        torch.testing.assert_close(model.block_forward(anchor, 12, aux, cache=cache),
                                   model.block_forward(anchor, 12, aux[:, :12]), rtol=1e-5, atol=1e-5)
        assert model.block_forward(anchor, 0, aux[:, :0]).shape == (1, model.config.block_size, 32)


@pytest.mark.parametrize(("overrides", "head_dim"), [
    ({"head_dim": 7}, 7),
    ({"hidden_size": 36, "target_hidden_size": 36}, 9),  # derived: 36 / 4 heads
])
def test_an_odd_head_dim_is_refused_when_the_config_is_built(overrides, head_dim):
    """RoPE rotates the two halves of each head: an odd head_dim used to build a draft that
    crashed at its first forward with torch's "size of tensor a (7) must match ... (8)"."""
    with pytest.raises(ValueError, match=f"^head_dim must be even .*got {head_dim}$"):
        tiny_config(**overrides)
    raw = asdict(tiny_config())
    raw.update(overrides)
    if "head_dim" not in overrides:
        raw["head_dim"] = None
    with pytest.raises(ExportError, match=f"^draft/config.json: head_dim must be even .*got {head_dim}$"):
        config_from_serving(raw, where="draft/config.json")


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_training_logits_equal_cached_inference_from_anchor_zero(head_type, backend):
    """Blocks at anchors 0 and 1 (no context, one position) and later ones: the packed training
    forward's teacher-forced logits and confidences equal block_forward (with and without a
    ContextCache grown block after block) followed by draft_block made to draft the labels."""
    if backend == "flex":
        pytest.importorskip("torch.nn.attention.flex_attention")
    model = tiny_draft(markov_head_type=head_type, num_key_value_heads=1, attention_backend=backend).eval()
    cfg = model.config
    input_ids, loss_mask, aux, _ = random_batch(cfg, batch=1, prompt_len=0)
    anchors = torch.tensor([[0, 1, 2, 9, 30]])
    layout = build_layout(input_ids, loss_mask, anchors, torch.ones_like(anchors, dtype=torch.bool),
                          cfg.block_size)
    cache = ContextCache()
    with torch.no_grad():
        packed = model.packed_hidden(input_ids, aux, layout)[0]
        latent, emb = model.markov_head.teacher_forced(layout.prev_tokens[0], packed)
        trained = model.lm_head(packed) + model.markov_head.markov_w2(latent)
        trained_conf = model.confidence_head(packed, emb)
        for a, p in enumerate(anchors[0].tolist()):
            anchor, labels = input_ids[:, p], layout.labels[0, a]
            whole = model.block_forward(anchor, p, aux[:, :p])
            cached = model.block_forward(anchor, p, aux, cache=cache)
            assert cache.length == p
            torch.testing.assert_close(whole[0], packed[a], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cached, whole, rtol=1e-5, atol=1e-5)
            tokens, logits, conf = model.draft_block(cached, anchor, sample=lambda _lg, k, t=labels: t[k : k + 1])
            assert torch.equal(tokens[0], labels)
            torch.testing.assert_close(logits[0], trained[a], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(conf[0], trained_conf[a], rtol=1e-5, atol=1e-5)
