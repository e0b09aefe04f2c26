"""Checkpoint and stop messages, round 16: a draft_config.json that is JSON but no object, the
setting a trainer-count refusal is about, what a rerun does when no checkpoint was written yet
(after a failed first save, a stop, a dead peer), and a full disk during a run."""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from draftforge.train import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]


def _single_checkpoint(run_dir: Path, step: int, *, ranks: int = 1) -> Path:
    """A complete single-strategy checkpoint folder as save_checkpoint lays it out."""
    path = ckpt.checkpoint_path(run_dir, step)
    (path / "rng").mkdir(parents=True)
    for rank in range(ranks):
        save_file({"cpu": torch.get_rng_state()}, str(path / "rng" / f"rank_{rank}.safetensors"))
    save_file({"w": torch.zeros(2)}, str(path / "model.safetensors"))
    save_file({"state.0.exp_avg": torch.zeros(2)}, str(path / "optimizer.safetensors"))
    (path / "optimizer.json").write_text(json.dumps({"param_groups": [{"lr": 0.1}], "scalars": {}}))
    (path / ckpt.DRAFT_CONFIG_FILE).write_text(json.dumps({"hidden_size": 64, "block_size": 4}))
    (path / ckpt.STATE_FILE).write_text(json.dumps({
        "step": step, "skipped_steps": 0, "strategy": "single",
        "consumed_ids": [[f"r{rank}"] for rank in range(ranks)]}))
    (path / ckpt.COMPLETE).write_text(f"step {step}\n")
    return path


# -- 1. a trainer-count refusal names the setting ---------------------------------------


def test_a_checkpoint_of_another_trainer_count_names_split_trainer_ranks(tmp_path):
    path = _single_checkpoint(tmp_path / "run", 4, ranks=2)
    assert ckpt.read_checked_state(path, strategy="single", trainer_ranks=2)["step"] == 4
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.read_checked_state(path, strategy="single", trainer_ranks=1)
    assert str(info.value) == (
        f"checkpoint {path} was written by 2 trainer rank(s); this run has 1. Resume with the same "
        "number of trainer ranks. Make split.trainer_ranks list 2 rank(s) (and split.world_size "
        "match), or start a fresh run in another train.output_dir")


# -- 2. a failed first checkpoint: the rerun starts over ---------------------------------


def test_a_failed_first_checkpoint_does_not_offer_a_resume(tmp_path):
    """'no earlier checkpoint exists. ... rerun the same command to resume.': that rerun starts
    over from step 0."""
    run_dir = tmp_path / "run"
    error = "OSError: [Errno 28] No space left on device"
    message = str(ckpt._write_failed(4, run_dir, [error]))
    assert message == (
        f"writing the checkpoint of step 4 into {run_dir / 'checkpoints'} failed (trainer rank 0: "
        f"{error}); nothing partial was kept, no earlier checkpoint exists. Free disk space (or fix "
        "the error) and rerun the same command to start over (there is no checkpoint to resume from).")
    previous = _single_checkpoint(run_dir, 4)
    assert str(ckpt._write_failed(8, run_dir, ["", error])) == (
        f"writing the checkpoint of step 8 into {run_dir / 'checkpoints'} failed (trainer rank 1: "
        f"{error}); nothing partial was kept, the previous checkpoint {previous} is intact and is "
        "what resume picks. Free disk space (or fix the error) and rerun the same command to resume.")


# -- 3. a draft_config.json that parses but is no object ---------------------------------


@pytest.mark.parametrize(("text", "kind"), [("null", "null"), ("[]", "an array"), ("5", "a number"),
                                            ('"hidden_size"', "a string"),
                                            ('["hidden_size"]', "an array")])
def test_a_draft_config_that_is_no_object_is_refused_naming_it(tmp_path, text, kind):
    """[] passed (the draft-shape check compared nothing); null, a number or a string raised a
    bare TypeError from the shape check."""
    path = _single_checkpoint(tmp_path / "run", 4)
    model_config = {"hidden_size": 64, "block_size": 4}
    assert ckpt.read_checked_state(path, model_config=model_config, strategy="single")["step"] == 4
    (path / ckpt.DRAFT_CONFIG_FILE).write_text(text)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.read_checked_state(path, model_config=model_config, strategy="single")
    assert str(info.value).startswith(
        f"checkpoint file {path / ckpt.DRAFT_CONFIG_FILE} is corrupt or truncated (ValueError: "
        f"{kind}, not an object of DSparkConfig fields); delete the folder {path}")


# -- 4. what a rerun does after a stop: a checkpoint or none -----------------------------

# Rank 0 writes a complete checkpoint when told to, then interrupts its launcher (this test's
# process) once, as Ctrl-C would; every rank then waits.
_RANK = (
    "import os, signal, sys, time\n"
    "if os.environ['RANK'] == '0':\n"
    "    if sys.argv[1]:\n"
    "        path = os.path.join(sys.argv[1], 'checkpoints', 'step_00000004')\n"
    "        os.makedirs(path)\n"
    "        open(os.path.join(path, 'trainer_state.json'), 'w').write('{\"step\": 4}')\n"
    "        open(os.path.join(path, 'COMPLETE'), 'w').write('step 4')\n"
    "    os.kill(os.getppid(), signal.SIGINT)\n"
    "time.sleep(60)\n"
)


@pytest.mark.parametrize("written", [False, True])
def test_a_stopped_job_says_whether_its_rerun_continues_or_starts_over(written, tmp_path, capsys,
                                                                      monkeypatch):
    """The launcher said 'rerun the same command to continue from the newest checkpoint' after
    Ctrl-C also when the run had written none (the rerun starts over); it is worked out at the
    stop, so a checkpoint written since the start counts."""
    from splitserve_helpers import tiny_recipe

    from draftforge.splitserve.launch import main as train_main
    from draftforge.splitserve.supervisor import JobInterrupted

    recipe = tiny_recipe(tmp_path)
    run_dir = tmp_path / "run"
    monkeypatch.setattr("draftforge.splitserve.launch.preflight", lambda cfg, **kwargs: None)
    monkeypatch.setattr("draftforge.splitserve.launch.rank_command",
                        lambda recipe, overrides: [sys.executable, "-c", _RANK,
                                                   str(run_dir) if written else ""])
    with pytest.raises(JobInterrupted) as stop:
        train_main([str(recipe)])
    assert stop.value.code == 128 + signal.SIGINT
    assert (ckpt.find_resume(run_dir, "auto") is not None) == written
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == ("draftforge train: stopped on SIGINT; " + (
        "rerun the same command to continue from the newest checkpoint" if written
        else "no checkpoint was written yet: the same command starts over")), last


def _rank_ctx(resume: str, run_dir: Path):
    lines = []
    # set in the recipe's file, not on the command line (cfg.override: None)
    cfg = SimpleNamespace(train=SimpleNamespace(resume=resume, output_dir=str(run_dir)), override=lambda key: None)
    return SimpleNamespace(cfg=cfg, log=lines.append), lines


def test_a_rank_whose_peer_died_says_whether_the_rerun_resumes(tmp_path):
    """The target rank said 'the run can be resumed ... newest checkpoint' with no checkpoint in
    train.output_dir, and with train.resume=PATH, whose rerun resumes from PATH again (refused
    once the run saved a later checkpoint)."""
    from draftforge.splitserve.roles import _say_how_to_resume

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ctx, lines = _rank_ctx("auto", run_dir)
    _say_how_to_resume(ctx, None)
    assert lines == [f"no checkpoint was written in {run_dir} yet: rerun the same command to start over"]
    start = _single_checkpoint(run_dir, 4)
    ctx, lines = _rank_ctx("auto", run_dir)
    _say_how_to_resume(ctx, None)
    assert lines == ["the run can be resumed: rerun the same command (train.resume=auto) to continue "
                     f"from the newest checkpoint in {run_dir}"]
    ctx, lines = _rank_ctx(str(start), run_dir)
    _say_how_to_resume(ctx, None)
    assert lines == [
        f"With train.resume={start} the same command resumes from {start} again (refused once "
        f"{run_dir} holds a later checkpoint); rerun with train.resume=auto to continue from the "
        "newest checkpoint instead."]


# -- 5. a full disk during a run: one line, and no restart -------------------------------

# Rank 1 (the trainer) runs run_rank with a role whose write fails as ``sys.argv[1]`` says;
# rank 0 (the target) stops as a peer of a dead rank does.
_FULL_DISK_RANK = (
    "import errno, os, sys, time\n"
    "if os.environ['RANK'] == '0':\n"
    "    time.sleep(1)\n"
    "    sys.exit(1)\n"
    "from draftforge.config import load_recipe\n"
    "from draftforge.splitserve import roles\n"
    "class Context:\n"
    "    def __init__(self, cfg, rank, world, mode):\n"
    "        self.cfg, self.role = cfg, 'trainer'\n"
    "        self.log = lambda message: print(f'[rank 1 trainer] {message}', file=sys.stderr)\n"
    "def write(ctx, bench):\n"
    "    code = getattr(errno, sys.argv[1])\n"
    "    raise OSError(code, os.strerror(code), os.path.join(ctx.cfg.train.output_dir, 'metrics.jsonl'))\n"
    "roles.RankContext, roles._run_trainer = Context, write\n"
    "roles.run_rank(load_recipe(sys.argv[2]))\n"
)


@pytest.mark.parametrize("error", ["ENOSPC", "EIO"])
def test_a_full_disk_during_a_run_is_one_line_and_not_restarted(error, tmp_path, capfd, monkeypatch):
    """ENOSPC from a write in the run printed a traceback and exited 1, which --max-restarts
    took for a failure worth restarting: each restart reloaded the target and failed the same
    way. Another OSError (EIO) is still a failure with its traceback, and restarted."""
    from splitserve_helpers import tiny_recipe

    from draftforge.splitserve import launch

    recipe = tiny_recipe(tmp_path)
    run_dir = tmp_path / "run"
    monkeypatch.setattr(launch, "preflight", lambda cfg, **kwargs: None)
    monkeypatch.setattr(launch, "rank_command", lambda recipe, overrides: [
        sys.executable, "-c", _FULL_DISK_RANK, error, str(recipe)])
    starts = []
    real = launch.run_ranks
    monkeypatch.setattr(launch, "run_ranks", lambda *a, **k: starts.append(1) or real(*a, **k))
    status = launch.main([str(recipe), "--max-restarts", "1"])
    err = capfd.readouterr().err  # the ranks' lines too
    if error == "EIO":
        assert status == 1 and len(starts) == 2, err
        assert "Traceback" in err
        return
    assert status == 2 and len(starts) == 1, err
    assert "Traceback" not in err, err
    code = errno.ENOSPC
    assert (f"[rank 1 trainer] error: {os.strerror(code)} (errno {code}, ENOSPC) writing "
            f"{run_dir / 'metrics.jsonl'}; free space there (or fix the quota or a read-only mount) "
            "and rerun the same command; a restart would fail the same way, so none is made") in err
    assert "a rank refused its input (exit status 2); a restart would fail the same way" in err


# -- 6. tests/faults/README.md lists the malformed inputs round 15 added -----------------


def test_the_faults_readme_lists_the_round_15_checks():
    text = " ".join((ROOT / "tests" / "faults" / "README.md").read_text().split())
    for name in ("test_ckpt_r15.py", "test_cli_r15.py", "test_target_r15.py", "test_ckpt_r16.py"):
        assert f"`tests/{name}` (" in text, name


def test_a_rank_does_not_promise_a_restart_after_an_input_error(tmp_path, monkeypatch):
    """With restarts left, a rank whose peer died said the launcher restarts the job; after a
    rank refused its input (the launcher's marker exists) the launcher makes none."""
    from draftforge.splitserve.launch import INPUT_ERROR_ENV, RESTARTS_LEFT_ENV
    from draftforge.splitserve.roles import _say_how_to_resume

    run_dir = tmp_path / "run"
    _single_checkpoint(run_dir, 4)
    marker = tmp_path / "input-error"
    monkeypatch.setenv(RESTARTS_LEFT_ENV, "3")
    monkeypatch.setenv(INPUT_ERROR_ENV, str(marker))
    ctx, lines = _rank_ctx("auto", run_dir)
    _say_how_to_resume(ctx, None)
    assert lines == ["the launcher restarts the job (3 restart(s) left), continuing from the newest "
                     f"checkpoint in {run_dir} where there is one"]
    marker.write_text("rank 0: bad prompt file\n")
    ctx, lines = _rank_ctx("auto", run_dir)
    _say_how_to_resume(ctx, None)
    assert lines == ["a rank refused its input (its message says why), so no restart is made: fix it first",
                     "the run can be resumed: rerun the same command (train.resume=auto) to continue "
                     f"from the newest checkpoint in {run_dir}"]
