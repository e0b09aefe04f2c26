"""Export, load-back and the llama.cpp check: round 19 fixes.

- ``draftforge eval llamacpp`` refuses, before fetching and building llama.cpp and converting
  the target (minutes), an export llama.cpp cannot run;
- a failed export removes the folders above ``--out`` that it made (the CLI says "no partial
  folder was left");
- ``target_layer_ids`` that SGLang and llama.cpp would read differently (a duplicate, or not
  ascending) are refused: by the exporter (duplicates) and by the loader (either).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from dspark_helpers import tiny_config, tiny_draft

from draftforge.errors import InputError
from draftforge.train import export as export_mod
from draftforge.train.export import ExportError, export_draft
from draftforge.train.hf_load import config_from_serving, load_exported_draft

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-cpu.yaml"


def _quiet(_line: str) -> None:
    pass


# ----------------------------------------------------------------------------- the llama.cpp check


class _Reached(Exception):
    pass


def _stop_at_the_target(monkeypatch):
    """The first slow step after the arguments are checked: finding (and converting) the target."""
    from draftforge.eval import llamacpp, llamacpp_check

    def reached(cfg):
        raise _Reached

    def no_fetch(*args, **kwargs):
        raise AssertionError("llama.cpp fetched for an export it cannot run")

    monkeypatch.setattr(llamacpp_check, "_target_folder", reached)
    monkeypatch.setattr(llamacpp, "fetch_source", no_fetch)
    monkeypatch.setattr(llamacpp, "build_tools", no_fetch)
    return llamacpp_check


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(markov_head_type="gated"), r"Markov head is 'gated'.*supports only 'vanilla'"),
        (dict(markov_head_type="rnn"), r"Markov head is 'rnn'"),
        (dict(confidence_head_with_markov=False), r"confidence head reads the hidden state alone"),
    ],
)
def test_llamacpp_check_refuses_an_export_llamacpp_cannot_run_up_front(tmp_path, monkeypatch, overrides, reason):
    """The converter refuses a gated or rnn Markov head only after the target is converted, and
    llama.cpp's runtime aborts on every prompt for a confidence head without the Markov input:
    the exporter knows both (its model card says SGLang only), so the check says so at once."""
    from eval_helpers import draft_config

    from draftforge.train.model import DSparkDraft

    check = _stop_at_the_target(monkeypatch)
    export = export_draft(DSparkDraft(draft_config(**overrides)), tmp_path / "export", progress=_quiet)
    with pytest.raises(InputError, match=r"config\.json: llama\.cpp cannot run this draft \(.*" + reason):
        check.main([str(export), "--recipe", str(RECIPE)])


def test_llamacpp_check_still_runs_an_export_llamacpp_can_run(tmp_path, monkeypatch):
    from eval_helpers import draft_config

    from draftforge.train.model import DSparkDraft

    check = _stop_at_the_target(monkeypatch)
    export = export_draft(DSparkDraft(draft_config()), tmp_path / "export", progress=_quiet)
    with pytest.raises(_Reached):
        check.main([str(export), "--recipe", str(RECIPE)])


# ----------------------------------------------------------------------------- atomic export


def test_a_failed_export_removes_the_folders_it_made_above_out(tmp_path, monkeypatch):
    def full_disk(state, folder, *, max_shard_size_mb):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_mod, "write_safetensors", full_disk)
    (tmp_path / "kept").mkdir()
    with pytest.raises(OSError, match="No space left"):
        export_draft(tiny_draft(), tmp_path / "kept" / "new" / "deeper" / "export", progress=_quiet)
    assert sorted(os.listdir(tmp_path)) == ["kept"]
    assert os.listdir(tmp_path / "kept") == []  # an existing folder above stays, empty as it was


def test_the_export_cli_on_a_full_disk_leaves_no_folder_under_a_new_out(tmp_path, monkeypatch, capsys):
    from dataclasses import asdict

    import safetensors.torch
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from draftforge.cli import main

    model = tiny_draft()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "model.safetensors"))
    (ckpt / "draft_config.json").write_text(json.dumps(asdict(model.config)))

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    assert main(["export", str(ckpt), "--out", str(tmp_path / "exports" / "v1")]) == 2
    assert "no partial folder was left" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_an_export_into_new_folders_still_succeeds(tmp_path):
    model = tiny_draft()
    out = export_draft(model, tmp_path / "a" / "b" / "export", progress=_quiet)
    loaded = load_exported_draft(out, embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


# ----------------------------------------------------------------------------- target layer order


def test_the_exporter_refuses_duplicate_target_layers(tmp_path):
    """SGLang captures each target layer once: an fc trained on [0, 2, 2] would get 2 features."""
    model = tiny_draft(target_layer_ids=[0, 2, 2])
    with pytest.raises(ExportError, match=r"target_layer_ids \[0, 2, 2\] name layer\(s\) \[2\] more than once"):
        export_draft(model, tmp_path / "export", progress=_quiet)
    assert not (tmp_path / "export").exists()


def _exported_config(tmp_path) -> dict:
    out = export_draft(tiny_draft(), tmp_path / "export", progress=_quiet)
    return json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("ids", [[4, 2, 0], [0, 4, 2], [0, 2, 2]])
def test_the_loader_refuses_target_layers_servers_read_differently(tmp_path, ids):
    """An export listing the layers otherwise than strictly ascending (written before draftforge
    sorted them, or by hand) is one draft to llama.cpp (listed order) and another to SGLang
    (ascending, each once); loading it would evaluate neither reliably."""
    raw = _exported_config(tmp_path)
    assert raw["target_layer_ids"] == [0, 2, 4]
    raw["target_layer_ids"] = raw["dflash_config"]["target_layer_ids"] = ids
    with pytest.raises(ExportError, match=r"X/config\.json: target_layer_ids .* are not strictly ascending"):
        config_from_serving(raw, where="X/config.json")


def test_the_loader_refuses_unsorted_layers_of_an_export_folder_naming_its_file(tmp_path):
    out = export_draft(tiny_draft(), tmp_path / "export", progress=_quiet)
    raw = json.loads((out / "config.json").read_text())
    raw["target_layer_ids"] = raw["dflash_config"]["target_layer_ids"] = [4, 2, 0]
    (out / "config.json").write_text(json.dumps(raw))
    model = tiny_draft()
    with pytest.raises(InputError, match=f"{out / 'config.json'}: target_layer_ids \\[4, 2, 0\\]"):
        load_exported_draft(out, embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight)


def test_ascending_layers_still_load_to_the_exported_config(tmp_path):
    raw = _exported_config(tmp_path)
    cfg = config_from_serving(raw)
    assert cfg.target_layer_ids == tiny_config().target_layer_ids == [0, 2, 4]
