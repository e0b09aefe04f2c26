"""The run folder's lock: a folder the run cannot lock (its lock path is a folder, or it cannot
be created) is refused with a message naming it, before the target loads; before, the error was
taken for "no flock on this file system" and the run went on holding nothing. A file system
that really has no flock still runs unlocked, as before."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest
from splitserve_helpers import tiny_recipe

from draftforge.config import load_recipe
from draftforge.splitserve.launch import preflight
from draftforge.train import checkpoint as ckpt


def test_a_lock_path_that_is_a_folder_is_refused_naming_it(tmp_path):
    run = tmp_path / "run"
    (run / ckpt.RUN_LOCK).mkdir(parents=True)
    with pytest.raises(ckpt.CheckpointError) as refused:
        ckpt.claim_run_dir(run)
    assert str(refused.value).startswith(
        f"train.output_dir {run}: cannot create or lock {run.absolute() / ckpt.RUN_LOCK}: Is a directory")


def test_the_launcher_refuses_it_before_anything_starts(tmp_path):
    cfg = load_recipe(tiny_recipe(tmp_path))
    (Path(cfg.train.output_dir) / ckpt.RUN_LOCK).mkdir(parents=True)
    with pytest.raises(ckpt.CheckpointError, match="cannot create or lock"):
        preflight(cfg)


def test_a_run_folder_under_a_file_is_refused(tmp_path):
    (tmp_path / "plain").write_text("x")
    with pytest.raises(ckpt.CheckpointError, match=r"cannot create or lock .*: Not a directory"):
        ckpt.claim_run_dir(tmp_path / "plain" / "run")


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_file_system_without_flock_still_runs_unlocked(tmp_path, monkeypatch, code):
    opened = []
    real_open = os.open

    def counting_open(*args, **kwargs):
        fd = real_open(*args, **kwargs)
        opened.append(fd)
        return fd

    def no_flock(fd, how):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "open", counting_open)
    monkeypatch.setattr(fcntl, "flock", no_flock)
    run = tmp_path / "run"
    ckpt.claim_run_dir(run)  # no error: nothing is held
    assert run.is_dir() and opened
    for fd in opened:  # and the lock file's descriptor was not left open
        with pytest.raises(OSError):
            os.fstat(fd)
    monkeypatch.undo()
    ckpt.claim_run_dir(run)  # a later claim in the same process really locks it
    try:
        assert (run / ckpt.RUN_LOCK).read_text() == str(os.getpid())
    finally:
        ckpt.release_run_dir(run)
