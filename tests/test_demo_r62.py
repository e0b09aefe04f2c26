"""`draftforge demo --retrain`: a DSpark-only edit of the recipe (Markov rank, loss weights) was
refused with --force as the only fix, which deletes both runs and the regenerated answers, so
the demo regenerated the answers (5-11 minutes on the CPU recipe) and trained the unchanged
DFlash ablation again (11 minutes). --retrain trains again only the runs that are not this
demo's (another recipe's, or trained on other answers), keeping the answers and the other run."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from test_demo_r58 import _recipe, _stubbed

from draftforge.eval import demo
from draftforge.eval.demo_state import ANSWERS_STAMP, _digest
from draftforge.train.checkpoint import RUN_LOCK


def _edit(recipe, section: str, key: str, value) -> None:
    data = yaml.safe_load(recipe.read_text())
    data[section][key] = value
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))


def test_retrain_trains_again_only_the_run_of_another_recipe(tmp_path, monkeypatch, capsys):
    recipe, paths = _recipe(tmp_path)
    _stubbed(monkeypatch, recipe, paths)
    assert demo.main([str(recipe)]) == 0
    answers = paths.data_file.stat().st_mtime_ns
    dflash = (paths.dflash_dir / "checkpoints" / "step_00000004" / "COMPLETE").stat().st_mtime_ns
    (paths.run_dir / "metrics.jsonl").write_text('{"step": 4, "loss": 9.0}\n')  # the old run's records
    (paths.run_dir / "config.1.yaml").write_text("an earlier segment's recipe\n")
    _edit(recipe, "draft", "markov_rank", 4)  # DSpark's only: the DFlash ablation has none
    capsys.readouterr()
    ran = _stubbed(monkeypatch, recipe, paths)
    assert demo.main([str(recipe)]) == 2  # without --retrain: refused, naming it
    err = capsys.readouterr().err
    assert f"{paths.run_dir} holds a DSpark run of a different recipe" in err
    assert "Rerun with --retrain to train it again on the same answers, or --force to train again from scratch" in err
    assert ran == []
    assert demo.main([str(recipe), "--retrain"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"--retrain: {paths.run_dir} holds a DSpark run of another recipe; it is trained again" in out
    assert f"--retrain: removing {paths.run_dir / 'checkpoints'}" in out
    # the stub trains into a fresh folder only (its mkdir refuses an existing checkpoint)
    assert [name for name, _ in ran] == ["train DSpark", "export", "eval-dspark", "export (model card)"]
    assert paths.data_file.stat().st_mtime_ns == answers  # kept, not regenerated
    assert (paths.dflash_dir / "checkpoints" / "step_00000004" / "COMPLETE").stat().st_mtime_ns == dflash
    assert "markov_rank: 4" in (paths.run_dir / "config.yaml").read_text()
    assert not (paths.run_dir / "metrics.jsonl").exists() and not (paths.run_dir / "config.1.yaml").exists()
    assert json.loads((paths.run_dir / ANSWERS_STAMP).read_text()) == {"sha256": _digest(paths.data_file)}
    # this demo's runs now: nothing to do
    ran.clear()
    assert demo.main([str(recipe), "--retrain"]) == 0
    assert ran == []


def test_retrain_trains_again_the_runs_trained_on_other_answers(tmp_path, monkeypatch, capsys):
    recipe, paths = _recipe(tmp_path)
    _stubbed(monkeypatch, recipe, paths)
    assert demo.main([str(recipe)]) == 0
    paths.data_file.write_text("answers written again since\n")  # e.g. 'draftforge data regenerate'
    capsys.readouterr()
    ran = _stubbed(monkeypatch, recipe, paths)
    assert demo.main([str(recipe)]) == 2
    assert "rerun the demo with --retrain to train it on these answers (or --force to start over)" in \
        capsys.readouterr().err
    assert demo.main([str(recipe), "--retrain"]) == 0, capsys.readouterr().err
    assert [name for name, _ in ran] == ["train DSpark", "train DFlash", "export", "eval-dspark", "eval-dflash",
                                         "export (model card)"]
    assert paths.data_file.read_text() == "answers written again since\n"
    for run in (paths.run_dir, paths.dflash_dir):
        assert json.loads((run / ANSWERS_STAMP).read_text()) == {"sha256": _digest(paths.data_file)}


def test_retrain_refuses_a_run_that_a_training_holds(tmp_path, monkeypatch, capsys):
    from draftforge.files import exclusive_lock

    recipe, paths = _recipe(tmp_path)
    _stubbed(monkeypatch, recipe, paths)
    assert demo.main([str(recipe)]) == 0
    _edit(recipe, "draft", "markov_rank", 4)
    capsys.readouterr()
    ran = _stubbed(monkeypatch, recipe, paths)
    with exclusive_lock(paths.run_dir / RUN_LOCK):  # as 'draftforge train' holds it while it trains
        assert demo.main([str(recipe), "--retrain"]) == 2
    err = capsys.readouterr().err
    assert "--retrain would delete a run that is training: " in err and f"process {os.getpid()}" in err, err
    assert ran == [] and (paths.run_dir / "checkpoints" / "step_00000004" / "COMPLETE").is_file()


@pytest.mark.parametrize("other", ["--force", "--skip-train"])
def test_retrain_with_force_or_skip_train_is_a_usage_error(tmp_path, capsys, other):
    recipe, _ = _recipe(tmp_path)
    with pytest.raises(SystemExit) as stop:
        demo.main([str(recipe), "--retrain", other])
    assert stop.value.code == 2
    assert "--retrain trains again the runs that are not this demo's, keeping the rest" in capsys.readouterr().err
