"""Session 50: an export whose config.json leaves out enable_confidence_head loads as SGLang
reads it (the head enabled), or is refused with the fix where it holds no head."""

from __future__ import annotations

import json
import re

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


def _config(folder):
    return json.loads((folder / "config.json").read_text())


def _serving(tmp_path, **edits):
    """The tiny draft's exported config.json with ``edits`` (None deletes a key)."""
    from draftforge.train.hf_load import config_from_serving

    folder = tmp_path / "export"
    if not folder.exists():
        export_draft(tiny_eval_draft(tiny_target()), folder, progress=lambda _: None)
    raw = _config(folder)
    for key, value in edits.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    return config_from_serving(raw, where="config.json")


@pytest.mark.parametrize("edits,message", [
    ({"dspark_config": {"mask_token_id": 5}},
     "config.json: dspark_config.mask_token_id is 5 but mask_token_id is 3: SGLang serves the dspark_config"),
    ({"text_config": {"markov_head_type": "gated"}},
     "text_config.markov_head_type is 'gated' but markov_head_type is 'vanilla'"),
    ({"dspark_markov_rank": 64}, "dspark_markov_rank is 64 but markov_rank is 16"),
    ({"dspark_block_size": 8}, "dspark_block_size is 8 but block_size is 4"),
    ({"dspark_noise_token_id": 7}, "dspark_noise_token_id is 7 but mask_token_id is 3"),
    ({"markov_head_type": None}, "no markov_head_type; SGLang's DSPARK loader refuses"),
    ({"rope_is_neox_style": False}, "rope_is_neox_style is False, but draftforge's draft applies NeoX-style"),
    ({"is_neox_style": False}, "is_neox_style is False"),
])
def test_a_config_sglang_reads_as_another_draft_is_refused(tmp_path, edits, message):
    """SGLang reads the mask token, Markov rank and head type from a dspark_-prefixed key, then
    dspark_config, then text_config, before the top level draftforge reads; it refuses a Markov
    draft without markov_head_type and honours interleaved RoPE. Each loaded silently as
    another draft than the one served."""
    with pytest.raises(ExportError, match=re.escape(message)):
        _serving(tmp_path, **edits)


def test_the_same_values_in_sglangs_places_and_absent_sizes_load_as_qwen3_defaults(tmp_path):
    same = _serving(tmp_path, dspark_config={"mask_token_id": 3, "markov_rank": 16}, rope_is_neox_style=True)
    assert same.mask_token_id == 3 and same.markov_rank == 16
    # transformers' Qwen3Config, which SGLang builds from the file, gives head_dim 128 and
    # 32768 positions where the keys are absent (not hidden / heads = 16 and 4096)
    from transformers import Qwen3Config

    absent = _serving(tmp_path, head_dim=None, max_position_embeddings=None)
    assert (absent.head_dim, absent.max_position_embeddings) == (
        Qwen3Config().head_dim, Qwen3Config().max_position_embeddings) == (128, 32768)


def test_the_llamacpp_check_reads_an_absent_confidence_flag_as_enabled(tmp_path):
    """Its up-front refusal took an absent enable_confidence_head as false, where loading takes it
    as true (SGLang's reading): a head without the Markov input then went past the refusal into
    minutes of fetching, building and converting, to fail at every prompt. It now reads the
    config as loading does (config_from_serving)."""
    from draftforge.errors import InputError
    from draftforge.eval.llamacpp_check import _check_llamacpp_can_run
    from draftforge.train.hf_load import config_from_serving

    raw = {k: v for k, v in _config(export_draft(tiny_eval_draft(tiny_target()), tmp_path / "export",
                                                 progress=lambda _: None)).items()
           if k != "enable_confidence_head"}
    raw["confidence_head_with_markov"] = False
    with pytest.raises(InputError, match="llama.cpp cannot run this draft"):
        _check_llamacpp_can_run(tmp_path, config_from_serving(raw))
    # no head: runs
    _check_llamacpp_can_run(tmp_path, config_from_serving({**raw, "enable_confidence_head": False}))
