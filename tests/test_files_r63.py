"""Session 63: a refused lock names the process that holds it.

A lock file's text is what its holder wrote. In a sticky folder a stale file of another user's
killed run cannot be replaced, so the next run locks it as it is, and a third run was told the
dead run's process id. Linux lists every flock's holder in /proc/locks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from draftforge.files import Locked, exclusive_lock, flock_holder
from draftforge.train.checkpoint import CheckpointError, claim_run_dir


def test_the_holder_is_read_from_the_lock_table(tmp_path):
    path = tmp_path / "x.lock"
    path.write_text("")
    st = os.stat(path)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    table = tmp_path / "locks"
    table.write_text(
        f"1: POSIX  ADVISORY  WRITE 11 {device} 0 EOF\n"  # an fcntl lock, not a flock
        f"2: FLOCK  ADVISORY  WRITE 22 {device}0 0 EOF\n"  # another inode with this one's digits first
        f"3: -> FLOCK  ADVISORY  WRITE 33 {device} 0 EOF\n"  # a waiter, not the holder
        f"3: FLOCK  ADVISORY  WRITE 44 {device} 0 EOF\n"
    )
    assert flock_holder(st, table) == "44"
    table.write_text("1: FLOCK  ADVISORY  WRITE 22 00:00:1 0 EOF\n")
    assert flock_holder(st, table) is None
    # pid 0: a holder in another pid namespace, not known here (the file's text is used then)
    table.write_text(f"1: FLOCK  ADVISORY  WRITE 0 {device} 0 EOF\n")
    assert flock_holder(st, table) is None
    assert flock_holder(st, tmp_path / "missing") is None


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="Linux's lock table")
def test_a_refusal_names_the_holder_not_the_files_text(tmp_path):
    """Another process holds the lock on a file that names a process long gone."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = run_dir / ".train.lock"
    lock.write_text("4242")
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time\n"
         "fd = os.open(sys.argv[1], os.O_RDONLY)\n"  # holds it as it is, as in a sticky folder
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "print('held', flush=True)\n"
         "time.sleep(60)\n",
         str(lock)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(Locked) as refused:
            with exclusive_lock(lock):
                pass
        assert refused.value.holder == str(holder.pid)
        with pytest.raises(CheckpointError, match=f"process {holder.pid} holds"):
            claim_run_dir(run_dir)
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 10
    while True:  # the lock is free once the holder is gone
        try:
            with exclusive_lock(lock):
                break
        except Locked:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_lock_whose_folder_goes_just_before_it_is_opened_makes_it_again(tmp_path, monkeypatch):
    """Another command made the folder, was refused and removed it (made_folder) between this
    one's mkdir and its open of the lock file: "No such file or directory" (a review replayed it)."""
    import shutil

    from draftforge import files

    folder = tmp_path / "runs"
    folder.mkdir()
    lock = folder / ".eval.lock"
    real_open = os.open
    removed = []

    def open_after_removal(file, flags, *args, **kwargs):
        if os.fspath(file) == str(lock) and not removed:
            shutil.rmtree(folder)  # the other command leaves, taking the empty folder with it
            removed.append(True)
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(files.os, "open", open_after_removal)
    with files.lock_or_refuse(lock, lambda holder: RuntimeError(holder)) as held:
        assert held and lock.is_file()
    assert removed == [True]
