"""Review round 58 of ``draftforge demo`` (``eval/demo*.py``): --skip-train on a run still being
trained, the DFlash ablation's position weighting, runs moved, the order of --skip-train's
messages, answers missing after both trainings, and what --force deletes."""

from __future__ import annotations

import json
import os
import shlex

import pytest
import yaml
from splitserve_helpers import tiny_recipe
from test_demo_r7 import _finished_run, _report

from draftforge.config import load_recipe
from draftforge.eval import demo
from draftforge.eval.demo_state import ANSWERS_STAMP, _digest
from draftforge.train.checkpoint import RUN_LOCK
from draftforge.train.export import export_digest


def _stubbed(monkeypatch, recipe, paths, *, measured=None) -> list:
    """Stages that leave what the real ones leave (the regenerated answers, a training's final
    checkpoint, an export folder, an evaluation's report.json); ``measured``: the label ->
    draft_fingerprint each report records. Returns the stages run, with their arguments."""
    ran = []

    def run_stage(name, args, **kw):
        ran.append((name, list(args)))
        if args[0] == "data":
            paths.data_file.parent.mkdir(parents=True, exist_ok=True)
            paths.data_file.write_text("answers\n")
        elif args[0] == "train":
            dflash = any(a.startswith("train.output_dir=") for a in args)
            _finished_run(paths.dflash_dir if dflash else paths.run_dir,
                          load_recipe(recipe, list(args[2:])).to_yaml())
        elif args[0] == "export":
            out = paths.export_dir
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text('{"architectures": ["Qwen3DSparkModel"]}')
            (out / "model.safetensors").write_bytes(b"weights")
            (out / "README.md").write_text("card")
            return [f"export_files={export_digest(out)}"]
        return []

    def run_side_by_side(jobs, log_dir, *, parallel):
        for label, args in jobs.items():
            ran.append((label, list(args)))
            folder = paths.eval_dir if label == "eval-dspark" else paths.dflash_eval_dir
            methods = ({"dspark": 1.5, "ngram": 1.1, "none": 1.0} if label == "eval-dspark"
                       else {"dspark": 1.2, "none": 1.0})
            report = _report({"humaneval": 8}, methods)
            report["command"] = "draftforge eval " + shlex.join(args[1:])
            if measured is not None:
                report["draft_fingerprint"] = measured[label]
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "report.json").write_text(json.dumps(report))

    monkeypatch.setattr(demo, "run_stage", run_stage)
    monkeypatch.setattr(demo, "run_side_by_side", run_side_by_side)
    monkeypatch.setattr(demo, "evaluations_side_by_side", lambda threads=1: False)
    monkeypatch.setattr(demo, "check_answers_file", lambda cfg: None)
    return ran


def _recipe(tmp_path):
    recipe = tiny_recipe(tmp_path, steps=4, overrides={"eval.workloads": ["humaneval"], "data.regenerate": True})
    return recipe, demo.demo_paths(load_recipe(recipe))


def _unfinished_run(run, cfg_yaml: str, steps=(2,)) -> None:
    for step in steps:
        checkpoint = run / "checkpoints" / f"step_{step:08d}"
        checkpoint.mkdir(parents=True)
        for name in ("COMPLETE", "trainer_state.json"):
            (checkpoint / name).write_text("{}")
    (run / "config.yaml").write_text(cfg_yaml)


def _both_runs(recipe, paths, make=_finished_run) -> None:
    """The DSpark and DFlash runs of this recipe, recording the answers file's digest."""
    cfg = load_recipe(recipe)
    paths.data_file.parent.mkdir(parents=True, exist_ok=True)
    paths.data_file.write_text("answers\n")
    make(paths.run_dir, load_recipe(recipe, demo.dspark_overrides(cfg, paths, "bigram")[0]).to_yaml())
    make(paths.dflash_dir, load_recipe(recipe, demo.dflash_overrides(paths)).to_yaml())
    for run in (paths.run_dir, paths.dflash_dir):
        (run / ANSWERS_STAMP).write_text(json.dumps({"sha256": _digest(paths.data_file)}))


# 1. --skip-train on a run still being trained

def test_skip_train_refuses_a_run_that_a_training_holds(tmp_path, monkeypatch, capsys):
    """The demo picked the run's newest checkpoint once and never looked at its training lock:
    export and evaluation then took whatever checkpoint was newest when each started."""
    from draftforge.files import exclusive_lock

    recipe, paths = _recipe(tmp_path)
    _both_runs(recipe, paths, _unfinished_run)
    ran = _stubbed(monkeypatch, recipe, paths)
    with exclusive_lock(paths.run_dir / RUN_LOCK):  # as 'draftforge train' holds it while it trains
        assert demo.main([str(recipe), "--skip-train"]) == 2
    err = capsys.readouterr().err
    assert (f"--skip-train: the DSpark run {paths.run_dir} is being trained (process {os.getpid()} holds "
            f"{paths.run_dir.absolute() / RUN_LOCK})") in err, err
    assert ran == [] and not paths.table.exists()


def test_skip_train_holds_the_runs_so_no_training_starts_meanwhile(tmp_path, monkeypatch):
    from draftforge.files import Locked, exclusive_lock

    recipe, paths = _recipe(tmp_path)
    _both_runs(recipe, paths, _unfinished_run)
    ran = _stubbed(monkeypatch, recipe, paths)
    stage = demo.run_stage

    def export_while_training_starts(name, args, **kw):
        for run in (paths.run_dir, paths.dflash_dir):
            with pytest.raises(Locked), exclusive_lock(run / RUN_LOCK):  # a training starting there
                pass
        return stage(name, args, **kw)

    monkeypatch.setattr(demo, "run_stage", export_while_training_starts)
    assert demo.main([str(recipe), "--skip-train"]) == 0
    assert [name for name, _ in ran] == ["export", "eval-dspark", "eval-dflash", "export (model card)"]
    assert not (paths.run_dir / RUN_LOCK).exists()  # let go (and removed) at the end


def test_skip_train_evaluates_the_dflash_checkpoint_it_names(tmp_path, monkeypatch):
    """The DFlash evaluation was given the run folder: it read whatever checkpoint was newest."""
    recipe, paths = _recipe(tmp_path)
    _both_runs(recipe, paths, _unfinished_run)
    ran = _stubbed(monkeypatch, recipe, paths)
    assert demo.main([str(recipe), "--skip-train"]) == 0
    dflash = dict(ran)["eval-dflash"]
    assert dflash[1] == str(paths.dflash_dir / "checkpoints" / "step_00000002")
    assert "DSpark step 2, DFlash step 2" in paths.table.read_text()


def test_a_report_of_other_weights_is_never_labelled_with_the_checkpoint_picked(tmp_path, monkeypatch, capsys):
    """demo.md said 'DSpark step 2' while the export and its report measured step 4 (written
    by a training meanwhile): the report's draft_fingerprint was never compared."""
    recipe, paths = _recipe(tmp_path)
    _both_runs(recipe, paths, _unfinished_run)
    monkeypatch.setattr(demo, "checkpoint_fingerprints", lambda checkpoint: {f"fp-{checkpoint.name}"},
                        raising=False)
    _stubbed(monkeypatch, recipe, paths, measured={"eval-dspark": "fp-step_00000004",
                                                  "eval-dflash": "fp-step_00000002"})
    assert demo.main([str(recipe), "--skip-train"]) == 2
    err = capsys.readouterr().err
    assert (f"{paths.eval_dir / 'report.json'} measured other weights (fp-step_00000004) than "
            f"{paths.run_dir / 'checkpoints' / 'step_00000002'}, the DSpark checkpoint the demo picked") in err, err
    assert not paths.table.exists()


def test_an_evaluation_of_other_weights_is_not_taken_as_current(tmp_path, monkeypatch):
    """eval_is_current compared times only: a report newer than the checkpoint, of a later one,
    was reused."""
    from draftforge.eval.demo_state import eval_is_current

    report = _report({"humaneval": 8}, {"dspark": 1.2, "none": 1.0})
    report["command"] = "draftforge eval x"
    report["draft_fingerprint"] = "fp-step_00000004"
    (tmp_path / "report.json").write_text(json.dumps(report))
    assert eval_is_current(tmp_path, ["x"], tmp_path / "missing")  # times and command: current
    assert not eval_is_current(tmp_path, ["x"], tmp_path / "missing", fingerprints={"fp-step_00000002"})
    assert eval_is_current(tmp_path, ["x"], tmp_path / "missing", fingerprints={"fp-step_00000004"})


# 2. the DFlash ablation's position weighting

def test_the_dflash_ablation_weights_positions_as_the_default_whatever_the_recipe(tmp_path):
    from draftforge.train.config import LossConfig

    recipe = tiny_recipe(tmp_path, steps=4, overrides={"train.loss.position_weighting": "dpace",
                                                       "data.regenerate": True})
    paths = demo.demo_paths(load_recipe(recipe))
    loss = load_recipe(recipe, demo.dflash_overrides(paths)).train.loss
    assert loss.position_weighting == LossConfig().position_weighting == "exp"
    assert (loss.ce_weight, loss.tv_weight, loss.bce_weight, loss.kl_weight) == (1, 0, 0, 0)


# 3. runs moved

def test_moving_the_demos_runs_keeps_the_dflash_run(tmp_path, monkeypatch, capsys):
    """train.output_dir is no trained setting, but the DFlash run's data.regenerated_file (a path,
    the DSpark run's answers) was compared as text: moved, it was 'a different recipe'."""
    recipe, paths = _recipe(tmp_path)
    _stubbed(monkeypatch, recipe, paths)
    assert demo.main([str(recipe)]) == 0
    os.replace(tmp_path / "run", tmp_path / "moved")
    os.replace(tmp_path / "run-dflash", tmp_path / "moved-dflash")
    data = yaml.safe_load(recipe.read_text())
    data["train"]["output_dir"] = str(tmp_path / "moved")
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    paths = demo.demo_paths(load_recipe(recipe))
    capsys.readouterr()
    ran = _stubbed(monkeypatch, recipe, paths)
    assert demo.main([str(recipe)]) == 0, capsys.readouterr().err
    assert not any(name.startswith(("train", "data")) for name, _ in ran), ran
    # what the answers hold is still checked: another file there is refused
    paths.data_file.write_text("other answers\n")
    assert demo.main([str(recipe)]) == 2
    assert "the DSpark draft was trained on other answers" in capsys.readouterr().err


# 4. --skip-train's messages in order

def test_skip_train_without_the_dflash_run_refuses_before_any_note(tmp_path, monkeypatch, capsys):
    recipe, paths = _recipe(tmp_path)
    _both_runs(recipe, paths)
    for entry in sorted(paths.dflash_dir.rglob("*"), reverse=True):
        entry.rmdir() if entry.is_dir() else entry.unlink()
    paths.dflash_dir.rmdir()
    _stubbed(monkeypatch, recipe, paths)
    assert demo.main([str(recipe), "--skip-train"]) == 2
    out, err = capsys.readouterr()
    assert f"--skip-train: {paths.dflash_dir} has no complete checkpoint; train it first" in err
    assert "used unchecked" not in out + err
    assert not paths.dflash_dir.exists()  # no lock file left in a folder made for it


def test_skip_train_notes_no_force_advice_that_does_nothing_there(tmp_path, monkeypatch, capsys):
    recipe, paths = _recipe(tmp_path)
    _both_runs(recipe, paths)
    (paths.dflash_dir / ANSWERS_STAMP).unlink()  # trained outside the demo
    _stubbed(monkeypatch, recipe, paths)
    assert demo.main([str(recipe), "--skip-train"]) == 0
    out = capsys.readouterr().out
    assert (f"demo: note: {paths.dflash_dir} records no answers it trained on (trained outside the demo, or "
            "before it recorded them): the DFlash draft is used unchecked; drop --skip-train and pass "
            "--force to train it again on these answers") in out, out
    assert "; --force trains it again" not in out


# 5. answers missing after both trainings

def test_answers_missing_after_both_trainings_are_not_regenerated(tmp_path, monkeypatch, capsys):
    """Stage 1 regenerated them (4-11 minutes on the real recipe), then refused the finished runs
    because the new answers differed."""
    recipe, paths = _recipe(tmp_path)
    _stubbed(monkeypatch, recipe, paths)
    assert demo.main([str(recipe)]) == 0
    paths.data_file.unlink()
    capsys.readouterr()
    ran = _stubbed(monkeypatch, recipe, paths)
    assert demo.main([str(recipe)]) == 0, capsys.readouterr().err
    assert ran == []
    out = capsys.readouterr().out
    assert (f"skipped: {paths.data_file} is missing, but both trainings are finished and record the same "
            "answers they trained on, so they are not regenerated") in out, out
    # two runs recording other answers: regenerated, and the comparison's checks then apply
    stamp = paths.dflash_dir / ANSWERS_STAMP
    kept = stamp.read_text()
    stamp.write_text(json.dumps({"sha256": "0" * 64}))
    ran.clear()
    demo.main([str(recipe)])
    assert [name for name, _ in ran][:1] == ["data regenerate"]
    stamp.write_text(kept)
    paths.data_file.unlink(missing_ok=True)
    ran.clear()
    # a training still to do needs them: regenerated then
    for entry in sorted(paths.dflash_dir.rglob("*"), reverse=True):
        entry.rmdir() if entry.is_dir() else entry.unlink()
    assert demo.main([str(recipe)]) == 0
    assert [name for name, _ in ran][:2] == ["data regenerate", "train DFlash"]


# 6. what --force deletes

def test_another_recipes_run_names_everything_force_deletes(tmp_path, monkeypatch, capsys):
    """A DSpark-only edit: '--force ... (it deletes that run)', where --force deletes both runs
    and the answers (in the DSpark run's folder) and regenerates and trains everything again."""
    recipe, paths = _recipe(tmp_path)
    _stubbed(monkeypatch, recipe, paths)
    assert demo.main([str(recipe)]) == 0
    data = yaml.safe_load(recipe.read_text())
    data["draft"]["markov_rank"] = 4
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    capsys.readouterr()
    assert demo.main([str(recipe)]) == 2
    err = capsys.readouterr().err
    assert (f"Rerun with --retrain to train it again on the same answers, or --force to train again from "
            f"scratch (it deletes both runs, DSpark's {paths.run_dir} "
            f"and DFlash's {paths.dflash_dir}, the regenerated answers {paths.data_file}, the export "
            f"{paths.export_dir} and the evaluations, then regenerates the answers and trains both drafts "
            "again), or move the folder away.") in err, err
    assert "(it deletes that run)" not in err
