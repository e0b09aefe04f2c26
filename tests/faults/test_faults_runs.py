"""Whole ``draftforge train`` jobs under faults (gloo, CPU): a trainer SIGKILLed, a loss gone non-finite.

The target killed mid-run (trainers stop within a bounded time naming the dead
rank, and the rerun resumes exactly) is proven by
tests/test_splitserve_runs.py::test_dead_target_stops_trainer_and_resume_is_exact and a
silent one by ::test_silent_target_times_out_with_its_rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from splitserve_helpers import PYTHON, ROOT, metrics, read_logs, spawn_ranks, tiny_recipe, wait_all

pytestmark = pytest.mark.distributed


STEPS = 24


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The per-step records of an uninterrupted 2-process run of the same tiny recipe."""
    work = tmp_path_factory.mktemp("reference")
    procs = spawn_ranks(tiny_recipe(work, steps=STEPS), 2, log_dir=work / "logs")
    assert wait_all(procs, 240) == [0, 0], read_logs(work / "logs", 2)
    return _by_step(metrics(work / "run"))


def _by_step(records):
    out = {}
    for record in records:
        if "step" in record and "loss" in record:
            out[record["step"]] = record
    return out


def _train_command(recipe: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled")
    return subprocess.Popen([PYTHON, "-m", "draftforge", "train", str(recipe)], cwd=ROOT, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _descendants(pid: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        children = [p for p, parent in parents.items() if parent == current]
        found += children
        frontier += children
    return found


def _rank_pid(root_pid: int, rank: int) -> int | None:
    for pid in _descendants(root_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"draftforge.train" in cmdline and f"RANK={rank}".encode() in environ:
            return pid
    return None


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc to find the trainer rank")
def test_sigkilled_trainer_rerun_resumes_without_losing_or_repeating_samples(tmp_path, reference):
    steps = STEPS

    work = tmp_path / "killed"
    work.mkdir()
    recipe = tiny_recipe(work, steps=steps)
    job = _train_command(recipe, work / "first.log")
    checkpoint = work / "run" / "checkpoints" / "step_00000004"
    deadline = time.monotonic() + 180
    while not checkpoint.exists():
        assert job.poll() is None, (work / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    trainer = _rank_pid(job.pid, 1)
    assert trainer is not None
    os.kill(trainer, signal.SIGKILL)  # the trainer dies mid-run, no chance to clean up
    status = job.wait(timeout=240)
    first = (work / "first.log").read_text()
    assert status != 0
    assert "Rerun the same command to resume from the newest checkpoint" in first
    killed_at = max(r["step"] for r in metrics(work / "run") if "loss" in r)
    assert killed_at < steps, "the trainer was killed before the end"

    again = _train_command(recipe, work / "second.log")  # the very same command
    assert again.wait(timeout=240) == 0, (work / "second.log").read_text()[-3000:]
    second = (work / "second.log").read_text()
    assert "resumed from" in second and "checkpoints/step_000000" in second
    resumed = _by_step(metrics(work / "run"))
    assert sorted(resumed) == sorted(reference) == list(range(1, steps + 1))
    for step in reference:
        assert resumed[step]["sample_ids"] == reference[step]["sample_ids"], step
        assert resumed[step]["loss"] == reference[step]["loss"], step
    ids = [i for step in sorted(resumed) for i in resumed[step]["sample_ids"]]
    assert len(ids) == len(set(ids)), "no sample repeated"


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc to find the target rank")
def test_an_interrupted_or_refused_job_is_not_restarted(tmp_path, monkeypatch):
    """split.restart_target restarts a job whose rank failed, never one the user or a
    scheduler stopped (Ctrl-C, SIGTERM): that ends with 128 + the signal."""
    from draftforge.splitserve import launch
    from draftforge.splitserve.supervisor import JobInterrupted

    recipe = tiny_recipe(tmp_path, overrides={"split.restart_target": True})
    starts = []

    def interrupted(*args, **kwargs):
        starts.append(kwargs)
        raise JobInterrupted(signal.SIGINT)

    monkeypatch.setattr(launch, "run_ranks", interrupted)
    with pytest.raises(SystemExit) as info:
        launch.main([str(recipe)])
    assert info.value.code == 130 and len(starts) == 1

    # nor one whose rank refused its input (exit 2): it would fail the same way again
    refused = []
    monkeypatch.setattr(launch, "run_ranks", lambda *a, **k: refused.append(k) or 2)
    assert launch.main([str(recipe)]) == 2 and len(refused) == 1
    failing = []
    monkeypatch.setattr(launch, "run_ranks", lambda *a, **k: failing.append(k) or 3)
    assert launch.main([str(recipe)]) == 3 and len(failing) == 4  # 3 restarts by default


def test_one_visible_gpu_is_not_taken_for_none(tmp_path, monkeypatch):
    """torch_cuda_visible() == [0] on a one-GPU machine; any([0]) is False, so the launcher
    set the CPU's one-thread default for ranks that run on the GPU."""
    from draftforge.splitserve import launch

    recipe = tiny_recipe(tmp_path)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    envs = []
    monkeypatch.setattr(launch, "run_ranks", lambda *a, **k: envs.append(k["env"]) or 0)
    for visible, expected in (([0], None), ([], "1")):
        monkeypatch.setattr(launch, "torch_cuda_visible", lambda v=visible: v)
        assert launch.main([str(recipe)]) == 0
        assert envs[-1].get("OMP_NUM_THREADS") == expected


def test_restart_target_restarts_the_job_and_training_continues_exactly(tmp_path, reference):
    """split.restart_target: true: a SIGKILLed target rank ends the job; the launcher starts
    every rank again, which resumes from the newest checkpoint; nothing lost or repeated."""
    steps = STEPS

    work = tmp_path / "restart"
    work.mkdir()
    recipe = tiny_recipe(work, steps=steps, overrides={"split.restart_target": True})
    job = _train_command(recipe, work / "out.log")
    checkpoint = work / "run" / "checkpoints" / "step_00000004"
    deadline = time.monotonic() + 180
    while not checkpoint.exists():
        assert job.poll() is None, (work / "out.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    target = _rank_pid(job.pid, 0)
    assert target is not None
    os.kill(target, signal.SIGKILL)
    assert job.wait(timeout=300) == 0, (work / "out.log").read_text()[-4000:]
    out = (work / "out.log").read_text()
    assert "restart 1 of 3 (split.restart_target)" in out
    assert "restart 1 of the job: a rank had failed" in out
    assert "continuing from the newest checkpoint" in out  # the launcher's line: one exists
    assert "resumed from" in out
    resumed = _by_step(metrics(work / "run"))
    assert sorted(resumed) == sorted(reference) == list(range(1, steps + 1))
    for step in reference:
        assert resumed[step]["sample_ids"] == reference[step]["sample_ids"], step
        assert resumed[step]["loss"] == reference[step]["loss"], step


def test_non_finite_loss_stops_the_cli_run_with_its_message_and_a_usable_checkpoint(tmp_path):
    """The trainer's own test (tests/test_trainer.py::test_non_finite_steps_are_skipped_counted_and_stop_the_run)
    feeds NaN features; here an absurd learning rate overflows the weights through the CLI."""
    recipe = tiny_recipe(tmp_path, steps=12, overrides={"train.lr": 1e30, "train.max_bad_steps": 1})
    job = _train_command(recipe, tmp_path / "out.log")
    assert job.wait(timeout=240) == 0
    out = (tmp_path / "out.log").read_text()
    assert "SKIPPED (non-finite)" in out
    assert ("stopping: 2 steps of this run had a non-finite loss or gradient (train.max_bad_steps=1); the "
            "checkpoint holds the last good weights. Check the data and lower train.lr.") in out
    assert "(max_bad_steps); checkpoint" in out
    checkpoints = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    assert checkpoints and (checkpoints[-1] / "COMPLETE").is_file()
    weights = load_file(str(checkpoints[-1] / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_deepspeed_under_a_split_checkpoints_and_resumes_exactly(tmp_path):
    """DeepSpeed saves and loads its checkpoint with barriers on the trainer group only
    (the target rank never joins them), also with a single DeepSpeed trainer rank.
    tests/test_splitserve_runs.py::test_three_process_run_deepspeed trains with two."""
    pytest.importorskip("deepspeed")
    recipe = tiny_recipe(tmp_path, steps=8, overrides={
        "train.strategy": "deepspeed", "train.zero_stage": 2, "split.peer_timeout_s": 20})
    first = _train_command(recipe, tmp_path / "first.log")
    assert first.wait(timeout=240) == 0, (tmp_path / "first.log").read_text()[-3000:]
    done = _by_step(metrics(tmp_path / "run"))
    assert sorted(done) == list(range(1, 9))
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / "step_00000004" / "deepspeed").is_dir()
    import shutil

    shutil.rmtree(checkpoints / "step_00000008")  # as if the run had died after step 4's checkpoint
    again = _train_command(recipe, tmp_path / "second.log")
    assert again.wait(timeout=240) == 0, (tmp_path / "second.log").read_text()[-3000:]
    assert "resumed from" in (tmp_path / "second.log").read_text()
    # metrics.jsonl is cut back to the resume step, so steps 5-8 below are the second run's
    second = (tmp_path / "second.log").read_text()
    assert f"step      8  loss {done[8]['loss']:.4f}" in second
    resumed = _by_step(metrics(tmp_path / "run"))
    assert sorted(resumed) == list(range(1, 9))
    for step in range(5, 9):
        assert resumed[step]["sample_ids"] == done[step]["sample_ids"], step
        assert resumed[step]["loss"] == done[step]["loss"], step
