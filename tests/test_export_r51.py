"""Session 51: exports that load into another draft than a server's, or into garbage, are
refused; a malformed --push-to-hub id is refused before the export."""

from __future__ import annotations

import json

import pytest
from eval_helpers import tiny_eval_draft, tiny_target
from safetensors.torch import load_file, save_file
from test_cli_r15 import _run

from draftforge.train.export import ExportError, export_draft
from draftforge.train.hf_load import load_exported_draft


@pytest.fixture
def exported(tmp_path):
    target = tiny_target()
    return export_draft(tiny_eval_draft(target), tmp_path / "export", progress=lambda _: None), target


def test_a_draft_with_nan_weights_is_refused_naming_the_tensor(exported):
    """A fc.weight full of NaN was evaluated to an acceptance length of 1.000, without a word."""
    folder, target = exported
    path = folder / "model.safetensors"
    state = load_file(str(path))
    state["fc.weight"] = state["fc.weight"].clone().fill_(float("nan"))
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(ExportError, match=r"fc\.weight holds NaN or infinite values"):
        load_exported_draft(folder, target=target)


def test_a_rope_theta_of_0_is_refused_not_read_as_absent(exported):
    """0 fell back to 10000 (read as no value), where a server would use 0."""
    folder, target = exported
    raw = json.loads((folder / "config.json").read_text())
    raw["rope_theta"] = 0
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ExportError, match="rope_theta must be a positive number, got 0.0"):
        load_exported_draft(folder, target=target)


def test_a_malformed_hub_id_is_refused_before_the_export(tmp_path, capsys):
    """'draftforge export ... --push-to-hub "bad repo id!!"' exported, then failed (exit 1)
    advising to check the network and the login."""
    from test_export import _write_checkpoint

    from draftforge.train.model import DSparkDraft

    _write_checkpoint(tmp_path / "ckpt", DSparkDraft(tiny_eval_draft(tiny_target()).config))
    code, _, err = _run(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--push-to-hub", "bad repo id!!"], capsys)
    assert code == 2
    assert "--push-to-hub 'bad repo id!!': not a Hub repository id" in err
    assert not (tmp_path / "out").exists()


def test_a_recipe_whose_target_does_not_fit_the_checkpoint_is_refused(tmp_path, capsys):
    """'export --recipe R' compared only R's draft section: a recipe for a target of another
    vocabulary gave a model card whose recipe said vocab_size 512 beside config.json's 49152."""
    import re
    from pathlib import Path

    from splitserve_helpers import tiny_recipe
    from test_export import _write_checkpoint

    from draftforge.cli import main
    from draftforge.config import load_recipe
    from draftforge.splitserve.launch import _model_config
    from draftforge.train.model import DSparkConfig, DSparkDraft

    recipe = tiny_recipe(tmp_path)
    config = DSparkConfig(**_model_config(load_recipe(recipe)))
    _write_checkpoint(tmp_path / "ckpt", DSparkDraft(config))
    assert main(["export", str(tmp_path / "ckpt"), "--recipe", str(recipe), "--out", str(tmp_path / "ok")]) == 0
    other = tmp_path / "other.yaml"
    other.write_text(re.sub(r"vocab_size: 8192", "vocab_size: 4096", Path(recipe).read_text()))
    code, _, err = _run(["export", str(tmp_path / "ckpt"), "--recipe", str(other), "--out", str(tmp_path / "out")], capsys)
    assert code == 2
    assert "vocab_size: recipe's target 'random' gives 4096, checkpoint 8192" in err
    assert not (tmp_path / "out").exists()


def test_messages_name_what_was_passed_in_place_of_a_checkpoint(tmp_path, exported):
    """An export passed to 'draftforge export', or one without config.json given to eval, was
    'draft_config.json is missing'; a run's checkpoints/ folder read 'no checkpoints/ folder'."""
    import shutil

    from test_export import _write_checkpoint

    from draftforge.train.export import load_training_checkpoint
    from draftforge.train.model import DSparkDraft

    folder, target = exported
    with pytest.raises(ExportError, match=r"an export \(it holds config.json, not draft_config.json\), where a "
                                          "training checkpoint is read"):
        load_training_checkpoint(folder)
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    (bare / "config.json").unlink()
    with pytest.raises(ExportError, match="a training checkpoint holds draft_config.json .* and an export holds "
                                          "config.json; neither is here"):
        load_training_checkpoint(bare)
    run = tmp_path / "run"
    _write_checkpoint(run / "checkpoints" / "step_00000002", DSparkDraft(tiny_eval_draft(target).config))
    with pytest.raises(ExportError, match=rf"a run's checkpoints folder; pass the run directory above it \({run}\)"):
        load_training_checkpoint(run / "checkpoints")
