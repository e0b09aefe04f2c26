"""Review round 57 of the target engine (checked otherwise against transformers itself).

* Packing a linear's bf16 weights assigned the weight, an ``nn.Parameter``, as a module
  attribute, which registers it: ``state_dict`` gained a key per packed linear, and a strict
  load of the model's own unpacked state failed.
* ``GrowingLayer.batch_select_indices`` selected rows over the whole preallocated buffer,
  writing (and so making resident) its never-filled part; it copies the filled positions now.
"""

from __future__ import annotations

import torch
from test_packed_linear import _linears, needs_ops
from transformers.cache_utils import DynamicLayer

from draftforge.splitserve.kv_cache import GrowingLayer
from draftforge.splitserve.packed_linear import pack_linear_weights


@needs_ops
def test_packing_leaves_the_state_dict_as_it_was():
    model = _linears()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert pack_linear_weights(model) == 2
    assert list(model.state_dict()) == list(before)
    assert [name for name, _ in model.named_parameters()] == ["0.weight", "2.weight"]
    model.load_state_dict(before, strict=True)  # the unpacked model's own state loads


def test_dropping_rows_keeps_the_growing_cache_equal_to_transformers():
    torch.manual_seed(0)
    ours, theirs = GrowingLayer(capacity=64), DynamicLayer()
    first = torch.randn(5, 2, 7, 4), torch.randn(5, 2, 7, 4)
    for layer in (ours, theirs):
        layer.update(*first)
    for _ in range(3):
        step = torch.randn(5, 2, 1, 4), torch.randn(5, 2, 1, 4)
        for layer in (ours, theirs):
            layer.update(*step)
    rows = torch.tensor([4, 1, 3])
    for layer in (ours, theirs):
        layer.batch_select_indices(rows)
    assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    assert ours._buffers[0].shape[2] == 64  # the capacity is kept for the steps to come
    for _ in range(2):
        step = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
        got, want = ours.update(*step), theirs.update(*step)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert ours.get_seq_length() == theirs.get_seq_length() == 12
