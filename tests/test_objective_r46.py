"""W2's gradient multiplied out per group of chunks (``objective._W2GradientSum``)."""

from __future__ import annotations

import pytest
import torch
from dspark_helpers import tiny_draft
from test_objective import _inputs, reference_loss

from draftforge.train import objective
from draftforge.train.objective import dspark_objective

W2 = "markov_head.markov_w2.weight"


def _grads(model, inputs, chunk_blocks):
    model.zero_grad()
    hidden, prev, labels, valid, target_hidden = inputs
    hidden = hidden.to(model.lm_head.weight.dtype).requires_grad_()
    out = dspark_objective(model, hidden, prev, labels, valid, target_hidden.to(hidden.dtype),
                           chunk_blocks=chunk_blocks)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads["hidden"] = hidden.grad.clone()
    return out.loss.detach(), grads


def _reference_grads(model, inputs):
    hidden, prev, labels, valid, target_hidden = inputs
    model.zero_grad()
    hidden = hidden.detach().double().requires_grad_()
    ref, _ = reference_loss(model, hidden, prev, labels, valid, target_hidden)
    ref.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads["hidden"] = hidden.grad.clone()
    model.zero_grad()
    return ref.detach(), grads


@pytest.mark.parametrize("group_chunks", [0, 1, 2, 3, 1000])
def test_w2_gradient_in_groups_matches_the_float64_reference(group_chunks, monkeypatch):
    """9 anchors in chunks of 2 blocks (5 chunks, the last of one block), W2's gradient
    multiplied out per chunk (0 and 1: no buffer), per 2 or 3 chunks (a group left part-filled
    at the end) or all at once: every gradient as autograd through the float64 reference."""
    model = tiny_draft(markov_head_type="vanilla")
    inputs = _inputs(model, seed=11, num_anchors=9)
    chunk_rows = 2 * model.config.block_size
    row_bytes = model.config.vocab_size * 4
    monkeypatch.setattr(objective, "W2_GROUP_BYTES", group_chunks * chunk_rows * row_bytes)
    loss, grads = _grads(model, inputs, chunk_blocks=2)
    ref, want = _reference_grads(model, inputs)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(want) and W2 in grads
    for name in want:
        torch.testing.assert_close(grads[name], want[name].float(), rtol=1e-4, atol=1e-6, msg=name)


def test_a_group_buffer_is_used_only_on_a_cpu_and_only_above_one_chunk(monkeypatch):
    w2 = torch.zeros(64, 4)
    monkeypatch.setattr(objective, "W2_GROUP_BYTES", 3 * 16 * 64 * 2)
    grouped = objective._W2GradientSum(w2, torch.bfloat16, torch.float32, chunk_rows=16, total_rows=100)
    assert grouped.grads.shape == (48, 64) and grouped.latents.shape == (48, 4)
    # fewer rows in the call than a group holds: the buffer is only as large as the call
    small = objective._W2GradientSum(w2, torch.bfloat16, torch.float32, chunk_rows=16, total_rows=40)
    assert small.grads.shape == (40, 64)
    # a single chunk, or a group of one chunk: no buffer, each chunk's product added directly
    assert objective._W2GradientSum(w2, torch.bfloat16, torch.float32, 16, 16).grads is None
    monkeypatch.setattr(objective, "W2_GROUP_BYTES", 0)
    assert objective._W2GradientSum(w2, torch.bfloat16, torch.float32, 16, 100).grads is None
    meta = objective._W2GradientSum(torch.zeros(64, 4, device="meta"), torch.bfloat16, torch.float32,
                                    16, 100)
    assert meta.grads is None  # any device but a CPU: per chunk


def _sum_in_groups(grads, latents, group_bytes, monkeypatch):
    monkeypatch.setattr(objective, "W2_GROUP_BYTES", group_bytes)
    rows = sum(g.shape[0] for g in grads)
    w2 = torch.zeros(grads[0].shape[1], latents[0].shape[1])
    total = objective._W2GradientSum(w2, torch.bfloat16, torch.float32, grads[0].shape[0], rows)
    for g, lat in zip(grads, latents, strict=True):
        total.add(g, lat)
    return total.total()


def test_bf16_sum_in_one_group_is_closer_to_the_exact_sum_than_per_chunk(monkeypatch):
    """In bf16 each product is rounded once: per group instead of per chunk. 12 chunks of 16
    rows against the float64 product of the same bf16 values."""
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(16, 300, generator=gen).bfloat16() for _ in range(12)]
    latents = [torch.randn(16, 8, generator=gen).bfloat16() for _ in range(12)]
    exact = torch.cat(grads).double().t() @ torch.cat(latents).double()
    per_chunk = _sum_in_groups(grads, latents, 0, monkeypatch)
    one_group = _sum_in_groups(grads, latents, 1 << 30, monkeypatch)
    four_groups = _sum_in_groups(grads, latents, 3 * 16 * 300 * 2, monkeypatch)
    assert per_chunk.dtype == one_group.dtype == torch.float32
    err = {name: float((got.double() - exact).abs().mean()) for name, got in
           (("per chunk", per_chunk), ("one group", one_group), ("four groups", four_groups))}
    assert err["one group"] < err["four groups"] < err["per chunk"], err
    # each element of a group's product is within half a bf16 unit of the exact value
    assert torch.all((one_group.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-12)


def _estimate_items(cfg):
    from draftforge.splitserve.dry_run import draft_parameter_counts, trainer_estimate

    with_emb, without = draft_parameter_counts(cfg)
    return {name.split(" (")[0]: value for name, value in trainer_estimate(cfg, with_emb, without).items}


def _w2_item(cfg):
    return _estimate_items(cfg).get("objective's W2 gradient group")


def test_the_dry_run_counts_the_w2_group_and_packed_lm_head_of_a_cpu_trainer_by_hand():
    """recipes/smollm2-cpu.yaml in float32: 3 samples of 320 tokens a micro-batch, 32 anchors
    each, blocks of 8 (768 rows, under the 1,344 that 256 MiB of 49,152-wide float32 rows hold
    in whole chunks of 64): 768 rows of gradient (49,152) and latent (256), 4 bytes each. None on
    a GPU trainer, nor where a micro-batch's blocks fit one chunk. In bf16 the same in 2 bytes,
    and the objective's packed copy of the 49,152 x 576 lm_head."""
    from pathlib import Path

    from draftforge.config import load_recipe

    recipe = Path(__file__).resolve().parents[1] / "recipes/smollm2-cpu.yaml"
    cfg = load_recipe(recipe, ["target.dtype=float32", "train.dtype=float32"])
    assert _w2_item(cfg) == 768 * (49152 + 256) * 4
    assert "objective's packed lm_head" not in _estimate_items(cfg)  # float32: not packed
    bf16 = _estimate_items(load_recipe(recipe, ["target.dtype=bfloat16", "train.dtype=bfloat16"]))
    assert bf16["objective's packed lm_head"] == 49152 * 576 * 2
    assert bf16["objective's W2 gradient group"] == 768 * (49152 + 256) * 2
    assert _w2_item(load_recipe(recipe, ["train.device=cuda"])) is None
    assert _w2_item(load_recipe(recipe, ["train.loss.chunk_blocks=96"])) is None
    assert _w2_item(load_recipe(recipe, ["draft.markov_rank=0", "draft.enable_confidence_head=false"])) is None
    ling = Path(__file__).resolve().parents[1] / "recipes/ling3-flash-dspark.yaml"
    assert _w2_item(load_recipe(ling, [])) is None  # devices [4, 5, 6, 7]


def test_target_logits_through_the_packed_lm_head_are_the_plain_products_bits(monkeypatch):
    """bf16 on a CPU: the frozen lm_head reordered once; each row count is checked against the
    plain product on its first use, and a changed lm_head (in place, or another tensor) is
    packed again. Compared with the plain product for every call."""
    from draftforge.splitserve import packed_linear

    products, outputs = [], []
    real = packed_linear.packed_product

    def recording(x, p):
        products.append(x.shape)
        outputs.append(real(x, p))
        return outputs[-1]

    monkeypatch.setattr(packed_linear, "packed_product", recording)
    objective._PACKED_CACHE.clear()
    gen = torch.Generator().manual_seed(4)
    lm_head = torch.randn(1000, 64, generator=gen).bfloat16()
    returned = []
    for blocks in (8, 8, 3, 8, 3):
        th = torch.randn(blocks, 8, 64, generator=gen).bfloat16()
        returned.append(objective._target_logits(th, lm_head))
        assert torch.equal(returned[-1], th @ lm_head.t())
    packed_ok = packed_linear.packed_copy(lm_head) is not None
    if packed_ok:  # first use of 64 and 24 rows checks; the later ones take the packed product
        assert products == [(8, 8, 64), (8, 8, 64), (3, 8, 64), (8, 8, 64), (3, 8, 64)]
        assert objective._PACKED_CACHE["exact"] == {64: True, 24: True}
        # the checks return the plain product; calls 2, 4 and 5 return the packed one itself
        assert returned[0] is not outputs[0] and returned[2] is not outputs[2]
        assert returned[1] is outputs[1] and returned[3] is outputs[3] and returned[4] is outputs[4]
    before = objective._PACKED_CACHE["packed"]
    with torch.no_grad():
        lm_head.mul_(2)  # an in-place change: packed again, not the stale copy
    th = torch.randn(8, 8, 64, generator=gen).bfloat16()
    assert torch.equal(objective._target_logits(th, lm_head), th @ lm_head.t())
    assert objective._PACKED_CACHE["packed"] is not before or before is None
    # float32, or packing off: the plain product, no packed copy
    lm32 = lm_head.float()
    assert torch.equal(objective._target_logits(th.float(), lm32), th.float() @ lm32.t())
    monkeypatch.setenv("DRAFTFORGE_PACKED_LINEAR", "off")
    other = lm_head.clone()
    assert torch.equal(objective._target_logits(th, other), th @ other.t())
    assert objective._PACKED_CACHE["packed"] is None


def test_a_row_count_whose_packed_product_differs_keeps_the_plain_product(monkeypatch):
    from draftforge.splitserve import packed_linear

    objective._PACKED_CACHE.clear()
    lm_head = torch.randn(100, 16).bfloat16()
    if packed_linear.packed_copy(lm_head) is None:
        pytest.skip("no oneDNN packing on this machine")
    monkeypatch.setattr(packed_linear, "packed_product", lambda x, p: torch.zeros(1))
    th = torch.randn(2, 8, 16).bfloat16()
    for _ in range(2):
        assert torch.equal(objective._target_logits(th, lm_head), th @ lm_head.t())
    assert objective._PACKED_CACHE["exact"] == {16: False}


def test_the_packed_lm_head_is_skipped_where_it_would_take_over_a_quarter_of_available_memory(monkeypatch):
    from draftforge.splitserve import packed_linear

    lm_head = torch.randn(100, 16).bfloat16()
    if not packed_linear._ops_available():
        pytest.skip("no oneDNN packing on this machine")
    monkeypatch.setattr(packed_linear, "_available_bytes", lambda: 4 * lm_head.nbytes - 1)
    assert packed_linear.packed_copy(lm_head) is None
    objective._PACKED_CACHE.clear()
    th = torch.randn(2, 8, 16).bfloat16()
    assert torch.equal(objective._target_logits(th, lm_head), th @ lm_head.t())
    assert objective._PACKED_CACHE["packed"] is None
    monkeypatch.setattr(packed_linear, "_available_bytes", lambda: 4 * lm_head.nbytes)
    assert packed_linear.packed_copy(lm_head) is not None


def test_a_first_chunk_with_nan_or_a_refusing_op_decides_nothing_or_keeps_the_plain_product(monkeypatch):
    """NaN equals nothing, so a non-finite first chunk would have sent its row count to the
    plain product for the whole run: it records no verdict. An op that raises is a verdict
    for the plain product, not a failed step."""
    from draftforge.splitserve import packed_linear

    objective._PACKED_CACHE.clear()
    lm_head = torch.randn(100, 16).bfloat16()
    if packed_linear.packed_copy(lm_head) is None:
        pytest.skip("no oneDNN packing on this machine")
    th = torch.randn(2, 8, 16).bfloat16()
    bad = th.clone()
    bad[0, 0, 0] = float("nan")
    got = objective._target_logits(bad, lm_head)
    assert torch.allclose(got, bad @ lm_head.t(), equal_nan=True)
    assert objective._PACKED_CACHE["exact"] == {}
    objective._target_logits(th, lm_head)
    assert objective._PACKED_CACHE["exact"] == {16: True}

    def refusing(x, p):
        raise RuntimeError("mkldnn refused")

    monkeypatch.setattr(packed_linear, "packed_product", refusing)
    other = torch.randn(3, 8, 16).bfloat16()
    assert torch.equal(objective._target_logits(other, lm_head), other @ lm_head.t())
    assert objective._PACKED_CACHE["exact"] == {16: True, 24: False}
    assert torch.equal(objective._target_logits(other, lm_head), other @ lm_head.t())


def test_the_w2_group_buffers_are_kept_for_later_calls_and_replaced_only_by_larger_ones():
    """Micro-batches differ in rows: a call needing fewer rows uses the front of the held
    buffer, one needing more replaces it, another vocabulary or dtype replaces it."""
    objective._GROUP_BUFFERS.clear()
    w2 = torch.zeros(5000, 4)

    def buffers(total_rows, dtype=torch.bfloat16, weight=w2):
        grouped = objective._W2GradientSum(weight, dtype, torch.float32, chunk_rows=16, total_rows=total_rows)
        return grouped.grads, grouped.latents

    grads, latents = buffers(64)
    assert grads.shape == (64, 5000) and latents.shape == (64, 4)
    again, _ = buffers(64)
    assert again.data_ptr() == grads.data_ptr()
    smaller, smaller_latents = buffers(48)
    assert smaller.shape == (48, 5000) and smaller.data_ptr() == grads.data_ptr()
    assert smaller_latents.shape == (48, 4) and smaller_latents.data_ptr() == latents.data_ptr()
    larger, _ = buffers(96)
    assert larger.shape == (96, 5000) and objective._GROUP_BUFFERS["buffers"][0].shape == (96, 5000)
    assert buffers(64)[0].data_ptr() == larger.data_ptr()
    assert buffers(64, torch.float32)[0].dtype == torch.float32
    assert objective._GROUP_BUFFERS["buffers"][0].shape == (64, 5000)
    assert buffers(64, weight=torch.zeros(6000, 4))[0].shape == (64, 6000)
