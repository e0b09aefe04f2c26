"""The demo's reruns after a review (session 48): what counts as another recipe's run, what an
interrupted --force says, where the DFlash run goes, and how --force deletes."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-cpu.yaml"


@pytest.mark.parametrize("override", ["train.max_bad_steps=50", "train.log_interval=5",
                                      "train.checkpoint_interval=20", "name=my-cpu",
                                      "split.peer_timeout_s=600"])
def test_settings_that_do_not_change_the_training_keep_a_finished_run(tmp_path, monkeypatch, capsys,
                                                                     override):
    """The trainer resumes across these without a note (NOT_TRAINED); the demo refused the run
    and told the user to delete it with --force."""
    from draftforge.config import load_recipe
    from draftforge.eval import demo_state
    from draftforge.train import checkpoint as ckpt
    from draftforge.train.recipe_changes import recipe_changes

    monkeypatch.setattr(ckpt, "complete_checkpoints", lambda run_dir: [run_dir / "step"])
    saved, changed = load_recipe(RECIPE).to_yaml(), load_recipe(RECIPE, [override]).to_yaml()
    assert changed != saved  # the override is in the recipe the demo compares
    (tmp_path / "config.yaml").write_text(saved)
    assert recipe_changes(saved, changed) == []  # the trainer's resume has no note to print
    assert demo_state.check_same_recipe(tmp_path, changed, "DSpark") is None  # kept, not refused
    assert capsys.readouterr() == ("", "")  # and nothing said about it
    assert (tmp_path / "config.yaml").read_text() == saved


def test_a_setting_that_changes_the_training_is_still_another_recipe(tmp_path, monkeypatch):
    from draftforge.config import load_recipe
    from draftforge.eval import demo, demo_state
    from draftforge.train import checkpoint as ckpt

    monkeypatch.setattr(ckpt, "complete_checkpoints", lambda run_dir: [run_dir / "step"])
    (tmp_path / "config.yaml").write_text(load_recipe(RECIPE).to_yaml())
    for override, says in (("train.steps=100", "steps: 100"), ("train.lr=0.002", "lr: 0.002"),
                           ("data.num_samples=64", "num_samples: 64")):
        with pytest.raises(demo.DemoError, match=says):
            demo_state.check_same_recipe(tmp_path, load_recipe(RECIPE, [override]).to_yaml(), "DSpark")


def test_without_untrained_drops_keys_and_sections_only_where_listed():
    from draftforge.train.recipe_changes import without_untrained

    tree = {"name": "x", "train": {"log_interval": 5, "lr": 1e-3, "wandb": {"project": "p"}},
            "eval": {"num_prompts": 8}, "split": {"peer_timeout_s": 60, "token_budget": 1024},
            "target": {"cache_dir": "/c", "model": "m"}}
    assert without_untrained(tree) == {"train": {"lr": 1e-3}, "split": {"token_budget": 1024},
                                       "target": {"model": "m"}}


def _write_run(run_dir: Path, overrides: list[str]) -> None:
    """A run folder as training leaves it: its resolved recipe and one complete checkpoint."""
    from draftforge.config import load_recipe

    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(
        load_recipe(RECIPE, [f"train.output_dir={run_dir}", *overrides]).to_yaml())
    step = run_dir / "checkpoints" / "step_000360"
    step.mkdir(parents=True)
    for name in ("COMPLETE", "trainer_state.json", "model.safetensors"):
        (step / name).write_text("x")


def test_force_refuses_a_dflash_folder_that_is_not_the_demos(tmp_path):
    """The -dflash folder is derived, named by no recipe: --force deletes it only when it holds
    a DFlash run written there, and refuses before deleting anything else."""
    from draftforge.eval import demo, demo_runs, demo_state

    mine = tmp_path / "exp-dflash"
    _write_run(mine, [])  # the user's own DSpark experiment under that name
    with pytest.raises(demo.DemoError, match="does not hold a DFlash run") as info:
        demo_state.check_dflash_removable(mine)
    assert info.value.exit_status == 2 and (mine / "config.yaml").is_file()
    (tmp_path / "plain-dflash").mkdir()
    (tmp_path / "plain-dflash" / "notes.txt").write_text("mine")
    with pytest.raises(demo.DemoError, match="does not hold a DFlash run"):
        demo_state.check_dflash_removable(tmp_path / "plain-dflash")
    ours = tmp_path / "run-dflash"
    _write_run(ours, list(demo_runs.DFLASH_OVERRIDES))
    demo_state.check_dflash_removable(ours)  # the demo's own: no error
    demo_state.check_dflash_removable(tmp_path / "absent-dflash")


def test_a_removal_stopped_midway_leaves_no_half_deleted_run(tmp_path, monkeypatch):
    """--force renames a run aside before deleting it: a stop in the middle leaves no checkpoint
    whose COMPLETE marker outlived its weights where the rerun looks."""
    import shutil

    from draftforge.eval import demo_state

    run = tmp_path / "run"
    _write_run(run, [])
    real_rmtree = shutil.rmtree

    def stopped(path, *args, **kwargs):
        for weights in Path(path).rglob("model.safetensors"):
            weights.unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_state.shutil, "rmtree", stopped)
    with pytest.raises(KeyboardInterrupt):
        demo_state.remove_output(run, keep=[tmp_path / "recipe.yaml"])
    assert not run.exists()
    assert demo_state.final_checkpoint(run, 360) is None
    monkeypatch.setattr(demo_state.shutil, "rmtree", real_rmtree)
    _write_run(run, [])  # the next --force clears what the stopped one left aside
    demo_state.remove_output(run, keep=[tmp_path / "recipe.yaml"])
    assert not run.exists() and not (tmp_path / ".run.removing").exists()


@pytest.mark.parametrize("output_dir", [".", "/", "runs/.."])
def test_an_output_dir_without_a_name_is_refused_clearly(output_dir):
    from draftforge.config import load_recipe
    from draftforge.eval import demo, demo_runs

    with pytest.raises(demo.DemoError, match="needs a name of its own") as info:
        demo_runs.demo_paths(load_recipe(RECIPE, [f"train.output_dir={output_dir}"]))
    assert info.value.exit_status == 2


def test_a_stopped_forced_demo_says_to_rerun_without_force(monkeypatch, capsys):
    from draftforge.eval import demo
    from draftforge.splitserve.supervisor import JobInterrupted

    def interrupted(args, command):
        args.forced = True
        raise demo.DemoError("stage 'train DFlash' failed (exit status 1): ...\nfix it and rerun the demo")

    monkeypatch.setattr(demo, "run_demo", interrupted)
    assert demo.main(["--force", str(RECIPE)]) == 1
    assert "rerun without --force" in capsys.readouterr().err

    def stopped(args, command):
        args.forced = args.force  # stopped after --force's deletions (before them: test_demo_r50)
        raise JobInterrupted(15)

    monkeypatch.setattr(demo, "run_demo", stopped)
    with pytest.raises(JobInterrupted):
        demo.main(["--force", str(RECIPE)])
    assert "rerun without --force" in capsys.readouterr().err
    with pytest.raises(JobInterrupted):
        demo.main([str(RECIPE)])
    assert "rerun the same command" in capsys.readouterr().err
