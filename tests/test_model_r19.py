"""Review r19 of the draft model and its objective: float64 precision of the fused objective,
batch streams of other lengths, non-integer config fields, bigram counts of tensor samples."""

from __future__ import annotations

import pytest
import torch
from dspark_helpers import random_batch, tiny_config, tiny_draft
from test_objective import _inputs, reference_loss

from draftforge.train.blocks import sample_anchors
from draftforge.train.markov_init import bigram_scores
from draftforge.train.objective import dspark_objective


@pytest.mark.parametrize(("head_type", "weighting", "kl_weight"),
                         [("vanilla", "exp", 0.0), ("gated", "dpace", 0.3), ("rnn", "exp", 0.3)])
def test_a_float64_draft_gets_float64_loss_and_analytic_gradients(head_type, weighting, kl_weight):
    """The fused chunked objective of a float64 draft equals autograd through the slow float64
    per-slot reference to float64 rounding (1e-10), not fp32's (the objective rounded its
    softmaxes, c*, weights, BCE and the backward scale to fp32, about 1e-7 off)."""
    model = tiny_draft(markov_head_type=head_type, dtype=torch.float64)
    hidden, prev, labels, valid, target_hidden = _inputs(model, seed=5)
    hidden = hidden.double().requires_grad_()
    target_hidden = target_hidden.double()
    kwargs = dict(position_weighting=weighting, kl_weight=kl_weight, decay=2.5)
    out = dspark_objective(model, hidden, prev, labels, valid, target_hidden, chunk_blocks=3, **kwargs)
    assert out.loss.dtype == torch.float64 and out.c_star.dtype == torch.float64
    out.loss.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    fused["hidden"] = hidden.grad.clone()
    model.zero_grad()
    hidden.grad = None
    ref, parts = reference_loss(model, hidden, prev, labels, valid, target_hidden,
                                weighting=weighting, kl_weight=kl_weight, decay=2.5)
    ref.backward()
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    expected["hidden"] = hidden.grad
    torch.testing.assert_close(out.loss.detach(), ref.detach(), rtol=1e-10, atol=1e-12)
    for key in ("ce", "tv", "bce"):
        assert getattr(out, key).item() == pytest.approx(parts[key], rel=1e-10)
    assert set(fused) == set(expected) and "markov_head.markov_w2.weight" in fused
    for name, grad in expected.items():
        torch.testing.assert_close(fused[name], grad, rtol=1e-9, atol=1e-12, msg=name)


def _batch():
    model = tiny_draft()
    input_ids, loss_mask, aux, final = random_batch(model.config, seed=4)
    anchors, anchor_valid = sample_anchors(loss_mask, 5, generator=torch.Generator().manual_seed(0))
    return model, [input_ids, loss_mask, aux, final, anchors, anchor_valid]


@pytest.mark.parametrize(("index", "name", "change"), [
    (2, "aux", lambda t: t[:, :-1]),
    (3, "final", lambda t: t[:, :-3]),
    (3, "final", lambda t: torch.cat([t, t[:, :2]], dim=1)),  # was accepted silently
    (1, "loss_mask", lambda t: t[:, 1:]),
    (2, "aux", lambda t: t[:1]),
])
def test_a_stream_of_other_positions_is_refused_naming_it(index, name, change):
    model, args = _batch()
    args[index] = change(args[index])
    with pytest.raises(ValueError, match=rf"^{name} has shape .* but input_ids is \[2, 40\]"):
        model(*args)


def test_anchors_and_their_validity_must_agree():
    model, args = _batch()
    args[5] = args[5][:, :-1]
    with pytest.raises(ValueError, match=r"anchors \(2, 5\) and anchor_valid \(2, 4\) must both be"):
        model(*args)


@pytest.mark.parametrize(("field", "value"), [
    ("block_size", 8.0), ("markov_rank", 8.0), ("markov_rank", "8"), ("mask_token_id", 5.0),
])
def test_a_non_integer_config_field_is_refused_naming_it(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be an integer, got {value!r}"):
        tiny_config(**{field: value})


@pytest.mark.parametrize("ids", [["1", 2], [True, 2], 4])
def test_target_layer_ids_must_be_integers(ids):
    with pytest.raises(ValueError, match=r"^target_layer_ids must be a list of integer layer ids"):
        tiny_config(target_layer_ids=ids)


def test_bigram_counts_tensor_samples_like_token_lists():
    """A tensor's elements hash by identity: every pair counted once, and a well-sampled
    previous token was reported as never occurring twice."""
    sequences = [[1, 2, 3, 1, 2, 3, 1, 2], [2, 3, 1, 2]]
    rows, cols, scores = bigram_scores(sequences)
    assert rows.tolist() == [1, 2, 3] and cols.tolist() == [1, 2, 3]
    t_rows, t_cols, t_scores = bigram_scores([torch.tensor(s) for s in sequences])
    assert torch.equal(t_rows, rows) and torch.equal(t_cols, cols)
    torch.testing.assert_close(t_scores, scores, rtol=0, atol=0)
