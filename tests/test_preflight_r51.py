"""Review round 51: checks that ran only after something was started or deleted. The dry run
did not run the training data's overlap check (a real run's target ranks refused the data only
after torchrun and the target load), and ``draftforge demo --force`` deleted the earlier runs
before a missing or overlapping training file was refused."""

from __future__ import annotations

import json

import pytest
from splitserve_helpers import tiny_recipe
from test_cli_r15 import _run as draftforge_run
from test_demo_r7 import _finished_run
from test_demo_r45 import _no_stages

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
    code, _, err = draftforge_run(argv, capsys)
    return code, err


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


def test_demo_force_refuses_an_output_dir_that_is_no_run(tmp_path, monkeypatch, capsys):
    """--force deleted train.output_dir whatever it held (here a thesis), where the -dflash
    twin and export.out_dir were checked to be the demo's first."""
    mine = tmp_path / "userstuff"
    mine.mkdir()
    (mine / "thesis.txt").write_text("precious")
    recipe = tiny_recipe(tmp_path, steps=4, overrides={"train.output_dir": str(mine)})
    _no_stages(monkeypatch)
    code, err = _run(["demo", str(recipe), "--force"], capsys)
    assert code == 2, err
    assert f"--force would delete {mine} (train.output_dir), but it holds neither a run" in err
    assert (mine / "thesis.txt").read_text() == "precious"


def test_demo_force_still_deletes_what_the_demo_wrote_before_training(tmp_path, monkeypatch, capsys):
    recipe = tiny_recipe(tmp_path, steps=4, overrides={"data.regenerate": True})
    run = tmp_path / "run"
    run.mkdir()
    (run / "regenerated.jsonl").write_text("")
    (run / "demo-answers.json").write_text("{}")
    _no_stages(monkeypatch)
    code, err = _run(["demo", str(recipe), "--force"], capsys)
    assert code == 1 and "a stage ran" in err  # past the deletions, to the stubbed training
    assert not (run / "regenerated.jsonl").exists()


def test_answers_written_over_their_own_prompts_are_refused_at_load(tmp_path):
    """data.regenerated_file naming one of data.train_files: regeneration would write the answers
    over the prompts, and 'draftforge demo --force' deleted the user's data file."""
    from draftforge.recipe_errors import RecipeError

    data = tmp_path / "mydata.jsonl"
    data.write_text(json.dumps({"prompt": "hi"}) + "\n")
    recipe = tiny_recipe(tmp_path, overrides={"data.train_files": [str(data)], "data.regenerate": True,
                                              "data.regenerated_file": str(data)})
    with pytest.raises(RecipeError, match="is also one of data.train_files, the prompts it answers"):
        load_recipe(recipe)
    # the default path, <train.output_dir>/regenerated.jsonl, too
    default = tmp_path / "run" / "regenerated.jsonl"
    recipe = tiny_recipe(tmp_path, overrides={"data.train_files": [str(default)], "data.regenerate": True})
    with pytest.raises(RecipeError, match="where the answers go by default"):
        load_recipe(recipe)


def test_demo_force_keeps_a_training_file_inside_the_run_folder(tmp_path, monkeypatch, capsys):
    """The file was read before the deletions (and so passed), then deleted with the run folder."""
    mine = tmp_path / "run" / "mydata.jsonl"
    recipe = tiny_recipe(tmp_path, steps=4, overrides={"data.train_files": [str(mine)]})
    mine.parent.mkdir()
    mine.write_text((tmp_path / "convs.jsonl").read_text())
    paths = demo.demo_paths(load_recipe(recipe))
    assert paths.run_dir == mine.parent
    _finished_run(paths.run_dir, load_recipe(recipe).to_yaml())
    _no_stages(monkeypatch)
    code, err = _run(["demo", str(recipe), "--force"], capsys)
    assert code == 2 and f"--force would delete {paths.run_dir}, which holds {mine}; refusing" in err
    assert mine.is_file()


def test_demo_force_deletes_what_a_stopped_demo_left_before_training(tmp_path, monkeypatch, capsys):
    """A demo stopped after stamping the DFlash folder (before its training wrote config.yaml)
    was refused as 'does not hold a DFlash run'; so was a run folder holding answers under a
    data.regenerated_file name of the recipe's own."""
    answers = tmp_path / "run" / "answers.jsonl"
    recipe = tiny_recipe(tmp_path, steps=4, overrides={"data.regenerate": True, "data.regenerated_file": str(answers)})
    paths = demo.demo_paths(load_recipe(recipe))
    paths.run_dir.mkdir()
    answers.write_text("")
    (paths.run_dir / "demo-answers.json").write_text("{}")
    paths.dflash_dir.mkdir()
    (paths.dflash_dir / "demo-answers.json").write_text("{}")
    (paths.dflash_dir / ".train.lock").write_text("123")  # its training killed while starting
    _no_stages(monkeypatch)
    code, err = _run(["demo", str(recipe), "--force"], capsys)
    assert code == 1 and "a stage ran" in err, err  # past the deletions
    assert not answers.exists() and not paths.dflash_dir.exists()


def test_demo_force_refuses_to_delete_what_a_running_training_or_regeneration_writes(tmp_path, monkeypatch, capsys):
    """--force renamed a run folder away while a training held its lock inside it: the training
    went on saving into a new folder of the same name, and a second training could take a new
    lock there. The same for the answers a 'data regenerate' was writing."""
    from draftforge.files import exclusive_lock

    recipe = tiny_recipe(tmp_path, steps=4, overrides={"data.regenerate": True})
    paths = demo.demo_paths(load_recipe(recipe))
    _finished_run(paths.run_dir, load_recipe(recipe).to_yaml())
    paths.data_file.write_text("")
    _no_stages(monkeypatch)
    with exclusive_lock(paths.run_dir / ".train.lock"):  # a training of this run, in another process
        code, err = _run(["demo", str(recipe), "--force"], capsys)
    assert code == 2 and "--force would delete a run that is training" in err, err
    assert (paths.run_dir / "checkpoints").is_dir()
    with exclusive_lock(paths.data_file.with_name(paths.data_file.name + ".lock")):
        code, err = _run(["demo", str(recipe), "--force"], capsys)
    assert code == 2 and "which 'draftforge data regenerate' (process" in err, err
    assert paths.data_file.is_file()
    code, err = _run(["demo", str(recipe), "--force"], capsys)  # nothing running: deleted as before
    assert code == 1 and not paths.data_file.exists()


def test_a_second_demo_on_the_same_runs_is_refused(tmp_path, monkeypatch, capsys):
    """Two demos ran the same stages into the same folders: duplicate evaluations at half speed,
    each truncating the other's logs, one failing an hour in on the export's lock."""
    recipe = tiny_recipe(tmp_path, steps=4)
    paths = demo.demo_paths(load_recipe(recipe))
    _no_stages(monkeypatch)
    with demo.demo_held(paths.run_dir):  # the first demo
        code, err = _run(["demo", str(recipe)], capsys)
    assert code == 2 and f"another draftforge demo is running on {paths.run_dir}" in err, err
    code, err = _run(["demo", str(recipe)], capsys)
    assert code == 1 and "a stage ran" in err  # alone, it runs
