"""Fault drills, round 36 (a tiny-debug run broken the way real jobs break): what a failed
checkpoint write says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from draftforge.train import checkpoint as ckpt

# -- 1. a full disk while safetensors writes a checkpoint file: the message names the file --


@pytest.mark.parametrize("failing", ["model.safetensors", "optimizer.safetensors"])
def test_a_full_disk_under_safetensors_names_the_file_it_was_writing(tmp_path, monkeypatch, failing):
    """safetensors' own error ("I/O error: No space left on device (os error 28)") names no
    file: on a full tmpfs the run stopped with a message that said neither which file nor
    where, although the README promises one line naming the file and the errno."""
    real_save = ckpt.save_file

    def full_disk(tensors, filename, *args, **kwargs):
        if Path(filename).name == failing:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real_save(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_file", full_disk)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    run_dir = tmp_path / "run"
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.save_checkpoint(run_dir=run_dir, step=10, strategy="single", model=model,
                             optimizer=optimizer, engine=None, state={"step": 10}, group=None,
                             keep_last=2)
    written = ckpt.checkpoint_path(run_dir, 10).with_name("step_00000010.tmp") / failing
    assert (f"(trainer rank 0: SafetensorError: Error while serializing: I/O error: No space left "
            f"on device (os error 28) (writing {written}));") in str(info.value)
    assert not list(ckpt.checkpoints_root(run_dir).iterdir())  # nothing partial left


def test_a_rank_says_the_launcher_restarts_the_job_when_it_will(tmp_path, monkeypatch, capsys):
    """With split.restart_target the surviving rank said 'rerun the same command' just before
    the launcher restarted the job by itself. The launcher now tells its ranks how many restarts
    are left; a rank says the launcher restarts the job while any are, else what it said."""
    from splitserve_helpers import tiny_recipe
    from test_ckpt_r16 import _rank_ctx, _single_checkpoint
    from test_launch_restarts import TWO_NODES, fake_job

    from draftforge.splitserve.launch import DEFAULT_RESTARTS, RESTARTS_LEFT_ENV
    from draftforge.splitserve.launch import main as train_main
    from draftforge.splitserve.roles import _say_how_to_resume

    recipe = tiny_recipe(tmp_path, overrides={"split.num_nodes": 2, "split.restart_target": True})
    starts = fake_job(monkeypatch, "run_torchrun", [1] * (DEFAULT_RESTARTS + 1))
    assert train_main([str(recipe), *TWO_NODES]) == 1
    capsys.readouterr()
    left = [start.get(RESTARTS_LEFT_ENV) for start in starts]
    assert left == [str(DEFAULT_RESTARTS - n) for n in range(DEFAULT_RESTARTS + 1)]

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _single_checkpoint(run_dir, 4)
    monkeypatch.setenv(RESTARTS_LEFT_ENV, "2")
    ctx, lines = _rank_ctx("auto", run_dir)
    _say_how_to_resume(ctx, None)
    assert lines == [f"the launcher restarts the job (2 restart(s) left), continuing from the newest "
                     f"checkpoint in {run_dir} where there is one"]
    monkeypatch.setenv(RESTARTS_LEFT_ENV, "0")  # the last start: its failure ends the job
    ctx, lines = _rank_ctx("auto", run_dir)
    _say_how_to_resume(ctx, None)
    assert lines == ["the run can be resumed: rerun the same command (train.resume=auto) to continue "
                     f"from the newest checkpoint in {run_dir}"]


def test_a_resume_says_it_leaves_a_save_that_did_not_finish(tmp_path, capsys):
    """A kill mid-save leaves ``step_N.tmp``: resume picks the checkpoint before it, and the
    folder went at the next checkpoint without a word; the run now says so when it resumes."""
    from test_export_r36 import _fit

    from draftforge.train import checkpoint as ckpt

    run = tmp_path / "run"
    _fit(run, "name: r36\n", steps=2)
    ckpt.release_run_dir(run)
    partial = run / "checkpoints" / "step_00000004.tmp"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    capsys.readouterr()
    _fit(run, "name: r36\n", steps=4)  # resumes from step 2, saves step 4
    ckpt.release_run_dir(run)
    out = capsys.readouterr().out
    assert (f"[trainer] note: step_00000004.tmp in {run / 'checkpoints'} is left by a save that did "
            "not finish (never resumed from; removed at the next checkpoint): resuming from "
            "step_00000002") in out
    assert not partial.exists() and ckpt.is_complete(run / "checkpoints" / "step_00000004")
