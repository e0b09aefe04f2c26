"""Session 53: ``demo --force`` deleted the whole ``train.output_dir`` once its config.yaml named
it, with the user's own files beside the run (a review put notes.txt and an analysis folder
there; both were gone)."""

from __future__ import annotations

import pytest
from splitserve_helpers import tiny_recipe
from test_demo_r7 import _finished_run
from test_demo_r45 import _no_stages

from draftforge.config import load_recipe
from draftforge.eval import demo, demo_state

# what a whole demo of recipes/tiny-debug.yaml left in its run folder (listed after one ran,
# session 53), plus what other commands write there
DEMO_RUN = ["accounting.jsonl", "checkpoints", "config.yaml", "demo-answers.json", "demo-export-recipe.yaml",
            "demo-export.json", "demo-logs", "demo.md", "eval", "eval-dflash", "export", "metrics.jsonl",
            "regenerated.jsonl", "run.json", "slot_acceptance.png", "summary.json"]
OTHERS = ["config.1.yaml", "tensorboard", "wandb", "wandb_id.txt", ".train.lock", ".export.lock",
          ".export.tmp-k2j3", ".summary.json.abc.tmp", ".eval.eval.lock", ".export.old-1"]


FOLDERS = {"checkpoints", "demo-logs", "eval", "eval-dflash", "export", "tensorboard", "wandb", ".export.tmp-k2j3"}


def _fill(run_dir, names):
    for name in names:
        if name in FOLDERS:
            (run_dir / name).mkdir(exist_ok=True)
        elif not (run_dir / name).exists():
            (run_dir / name).write_text("x")


def test_force_refuses_a_run_folder_holding_the_users_own_files(tmp_path, monkeypatch, capsys):
    recipe = tiny_recipe(tmp_path, steps=4)
    paths = demo.demo_paths(load_recipe(recipe))
    _finished_run(paths.run_dir, load_recipe(recipe).to_yaml())
    _finished_run(paths.dflash_dir, load_recipe(recipe, demo.dflash_overrides(paths)).to_yaml())
    _fill(paths.run_dir, DEMO_RUN + OTHERS)
    assert demo_state.foreign_entries(paths.run_dir) == []  # everything draftforge writes there
    (paths.run_dir / "notes.txt").write_text("important")
    (paths.run_dir / "my_analysis").mkdir()
    _no_stages(monkeypatch)
    assert demo.main([str(recipe), "--force"]) == 2
    err = capsys.readouterr().err
    assert (f"--force would delete {paths.run_dir} (train.output_dir), a run folder that also holds what no "
            "draftforge command writes there: my_analysis, notes.txt; refusing") in err, err
    assert (paths.run_dir / "notes.txt").read_text() == "important" and (paths.run_dir / "checkpoints").is_dir()
    assert (paths.dflash_dir / "checkpoints").is_dir()  # refused before anything was deleted


def test_force_refuses_a_dflash_run_folder_holding_the_users_own_files(tmp_path):
    recipe = tiny_recipe(tmp_path, steps=4)
    paths = demo.demo_paths(load_recipe(recipe))
    _finished_run(paths.dflash_dir, load_recipe(recipe, demo.dflash_overrides(paths)).to_yaml())
    demo_state.check_dflash_removable(paths.dflash_dir)  # the demo's own: no error
    (paths.dflash_dir / "plot.py").write_text("mine")
    with pytest.raises(demo.DemoError, match="also holds what no draftforge command writes there: plot.py"):
        demo_state.check_dflash_removable(paths.dflash_dir)


def test_force_takes_the_demos_own_outputs_the_recipe_puts_in_the_run_folder(tmp_path, monkeypatch, capsys):
    """A review of this change: an export.out_dir inside the run folder (RUN/hf-export) was
    called a foreign entry, and so were a trainer group's .shared-check-* marker (left by a
    run killed between writing and removing it) and the calibration.json eval suggests."""
    run = tmp_path / "run"
    recipe = tiny_recipe(tmp_path, steps=4, overrides={"export.out_dir": str(run / "hf-export")})
    paths = demo.demo_paths(load_recipe(recipe))
    _finished_run(paths.run_dir, load_recipe(recipe).to_yaml())
    _finished_run(paths.dflash_dir, load_recipe(recipe, demo.dflash_overrides(paths)).to_yaml())
    (run / "hf-export").mkdir()
    (run / ".shared-check-0123abcd").write_text("written by trainer rank 1\n")
    (run / "calibration.json").write_text("{}")
    demo_state.check_run_removable(paths.run_dir, paths.data_file, also=(paths.export_dir,))
    with pytest.raises(demo.DemoError, match="hf-export"):  # not passed: the user's own
        demo_state.check_run_removable(paths.run_dir, paths.data_file)
