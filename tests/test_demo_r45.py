"""Review round 45 of ``draftforge demo`` (``eval/demo.py``, ``eval/demo_state.py``)."""

from __future__ import annotations

import json

import pytest
from splitserve_helpers import tiny_recipe
from test_demo_r7 import _finished_run

from draftforge.config import load_recipe
from draftforge.eval import demo


def _no_stages(monkeypatch):
    def stop(*args, **kwargs):
        raise demo.DemoError("a stage ran", exit_status=1)

    monkeypatch.setattr(demo, "run_stage", stop)
    monkeypatch.setattr(demo, "run_side_by_side", stop)
    monkeypatch.setattr(demo, "evaluations_side_by_side", lambda threads=1: False)


@pytest.mark.parametrize("skip_train", [False, True])
def test_force_refuses_an_export_out_dir_that_is_not_an_export_before_deleting_anything(
        tmp_path, monkeypatch, capsys, skip_train):
    """--force deleted the recipe's export.out_dir whatever it held (here a folder of other
    drafts and notes), where draftforge export refuses to replace a folder that is not an
    export; and it deleted the runs before any refusal of a later output."""
    models = tmp_path / "models"
    (models / "other-draft").mkdir(parents=True)
    (models / "other-draft" / "config.json").write_text("{}")
    (models / "notes.txt").write_text("precious")
    recipe = tiny_recipe(tmp_path, steps=4, overrides={"export.out_dir": str(models)})
    paths = demo.demo_paths(load_recipe(recipe))
    _finished_run(paths.run_dir, load_recipe(recipe).to_yaml())
    _finished_run(paths.dflash_dir, load_recipe(recipe, demo.dflash_overrides(paths)).to_yaml())
    _no_stages(monkeypatch)

    assert demo.main([str(recipe), "--force", *(["--skip-train"] if skip_train else [])]) == 2
    err = capsys.readouterr().err
    assert f"--force would delete {models} (export.out_dir): export destination {models} is a non-empty " \
           "folder that is not an export" in err, err
    assert "set another export.out_dir" in err
    assert (models / "notes.txt").read_text() == "precious" and (models / "other-draft" / "config.json").is_file()
    assert (paths.run_dir / "checkpoints").is_dir() and (paths.dflash_dir / "checkpoints").is_dir()


def test_force_still_deletes_an_earlier_export_in_export_out_dir(tmp_path, monkeypatch):
    """An earlier export there (a DSpark config.json, the files an export writes) is the
    demo's to redo: --force deletes it as before."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "config.json").write_text(json.dumps({"architectures": ["Qwen3DSparkModel"]}))
    (models / "model.safetensors").write_bytes(b"weights")
    (models / "README.md").write_text("card")
    recipe = tiny_recipe(tmp_path, steps=4, overrides={"export.out_dir": str(models)})
    _no_stages(monkeypatch)
    assert demo.main([str(recipe), "--force"]) == 1  # the training stage, stubbed to fail
    assert not models.exists()
