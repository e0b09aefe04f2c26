"""``draftforge bench split``'s failure gives no resume advice (that its phases longer than
``split.peer_timeout_s`` are not silence is tested with its real run in test_bench_split.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from draftforge.splitserve.roles import _say_how_to_resume


def _ctx(resume: str, output_dir="/runs/x"):
    lines = []
    cfg = SimpleNamespace(train=SimpleNamespace(resume=resume, output_dir=str(output_dir)))
    return SimpleNamespace(cfg=cfg, log=lines.append), lines


@pytest.mark.parametrize(("resume", "bench", "advised"), [
    ("auto", None, True),
    ("never", None, False),  # a rerun starts over
    ("never", {"steps": 2}, False),  # the benchmark: its scratch run is gone
    ("auto", {"steps": 2}, False),
])
def test_resume_advice_only_where_a_rerun_resumes(tmp_path, resume, bench, advised):
    checkpoint = tmp_path / "checkpoints" / "step_00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "COMPLETE").write_text("")
    (checkpoint / "trainer_state.json").write_text("{}")
    ctx, lines = _ctx(resume, tmp_path)
    _say_how_to_resume(ctx, bench)
    assert lines == ([f"the run can be resumed: rerun the same command (train.resume={resume}) "
                      f"to continue from the newest checkpoint in {tmp_path}"] if advised else [])


def test_a_run_folder_never_made_has_no_checkpoint_to_resume(tmp_path):
    """A trainer killed before it made train.output_dir: the target rank said the run could be
    resumed where the launcher said it starts over (round 58)."""
    ctx, lines = _ctx("auto", tmp_path / "never-made")
    _say_how_to_resume(ctx, None)
    assert lines == [f"no checkpoint was written in {tmp_path / 'never-made'} yet: rerun the same "
                     "command to start over"]


def test_the_launcher_offers_no_resume_to_a_run_that_never_resumes(tmp_path, capsys, monkeypatch):
    """With train.resume=never the launcher said 'Rerun the same command to resume from the
    newest checkpoint ... (train.resume=never)': that rerun starts over, or is refused."""
    from splitserve_helpers import tiny_recipe

    from draftforge.splitserve.launch import main as train_main

    recipe = tiny_recipe(tmp_path)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "COMPLETE").write_text("")
    (checkpoint / "trainer_state.json").write_text("{}")
    monkeypatch.setattr("draftforge.splitserve.launch.run_ranks", lambda *a, **k: 1)
    monkeypatch.setattr("draftforge.splitserve.launch.preflight", lambda cfg, **kwargs: None)
    assert train_main([str(recipe), "train.resume=never"]) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == (
        "draftforge train: the job failed (exit status 1); the messages above name the failing "
        f"rank. With train.resume=never the same command is now refused ({tmp_path / 'run'} holds "
        "step_00000004, later than where it would start); rerun with train.resume=auto in place of "
        "'train.resume=never' to continue from "
        f"{checkpoint}.")
