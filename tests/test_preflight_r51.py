"""Review round 51: checks that ran only after something was started or deleted. The dry run
did not run the training data's overlap check (a real run's target ranks refused the data only
after torchrun and the target load), and ``draftforge demo --force`` deleted the earlier runs
before a missing or overlapping training file was refused."""

from __future__ import annotations

import json

import pytest
from splitserve_helpers import tiny_recipe
from test_demo_r7 import _finished_run
from test_demo_r45 import _no_stages

from draftforge.cli import main as draftforge_main
from draftforge.config import load_recipe
from draftforge.data.workloads import load_workload
from draftforge.eval import demo


def _overlapping_file(tmp_path):
    """Two training conversations, one of them a GSM8K evaluation question."""
    question = load_workload("gsm8k")[3].text
    rows = [{"id": "mine", "messages": [{"role": "user", "content": "Name three colours."},
                                        {"role": "assistant", "content": "Red, green and blue."}]},
            {"id": "copied", "messages": [{"role": "user", "content": question},
                                          {"role": "assistant", "content": "The answer is 4."}]}]
    path = tmp_path / "overlapping.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(argv, capsys):
    try:
        code = draftforge_main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_the_dry_run_refuses_training_data_that_overlaps_the_evaluation_workloads(tmp_path, capsys):
    recipe = tiny_recipe(tmp_path, overrides={"data.train_files": [str(_overlapping_file(tmp_path))],
                                              "data.overlap_check": True})
    code, err = _run(["train", str(recipe), "--dry-run"], capsys)
    assert code == 2, err
    assert "1 training prompts overlap the evaluation workloads" in err
    assert "training 'copied'" in err and "line 2" in err
    # the check is the recipe's: turned off, the same data is accepted
    code, err = _run(["train", str(recipe), "--dry-run", "data.overlap_check=false"], capsys)
    assert code == 0, err


@pytest.mark.parametrize("problem", ["missing", "overlap"])
def test_demo_force_refuses_bad_training_data_before_deleting_the_runs(tmp_path, monkeypatch, capsys, problem):
    data = tmp_path / "gone.jsonl" if problem == "missing" else _overlapping_file(tmp_path)
    recipe = tiny_recipe(tmp_path, steps=4, overrides={"data.train_files": [str(data)],
                                                       "data.overlap_check": True})
    paths = demo.demo_paths(load_recipe(recipe))
    _finished_run(paths.run_dir, load_recipe(recipe).to_yaml())
    _finished_run(paths.dflash_dir, load_recipe(recipe, demo.dflash_overrides(paths)).to_yaml())
    _no_stages(monkeypatch)
    code, err = _run(["demo", str(recipe), "--force"], capsys)
    assert code == 2, err
    assert str(data) in err
    assert ("data file not found" in err) if problem == "missing" else ("overlap the evaluation" in err)
    assert (paths.run_dir / "checkpoints").is_dir() and (paths.dflash_dir / "checkpoints").is_dir()
