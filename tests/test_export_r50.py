"""Session 50: an export whose config.json leaves out enable_confidence_head loads as SGLang
reads it (the head enabled), or is refused with the fix where it holds no head."""

from __future__ import annotations

import json

import pytest
import torch
from eval_helpers import tiny_eval_draft, tiny_target

from draftforge.train.export import ExportError, export_draft
from draftforge.train.hf_load import load_exported_draft


def _without_flag(folder):
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    del raw["enable_confidence_head"]
    path.write_text(json.dumps(raw))


def test_an_absent_enable_confidence_head_means_enabled_as_in_sglang(tmp_path):
    target = tiny_target()
    draft = tiny_eval_draft(target)
    folder = export_draft(draft, tmp_path / "export", progress=lambda _: None)
    _without_flag(folder)
    loaded = load_exported_draft(folder, target=target)
    assert loaded.config.enable_confidence_head
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_an_absent_flag_without_the_heads_tensors_is_refused_with_the_fix(tmp_path):
    target = tiny_target()
    folder = export_draft(tiny_eval_draft(target, enable_confidence_head=False), tmp_path / "export",
                          progress=lambda _: None)
    assert load_exported_draft(folder, target=target).confidence_head is None  # as exported: loads
    _without_flag(folder)
    with pytest.raises(ExportError, match='has no enable_confidence_head, which SGLang takes as true .* add '
                                          '"enable_confidence_head": false'):
        load_exported_draft(folder, target=target)
