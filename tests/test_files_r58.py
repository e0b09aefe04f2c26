"""Session 58: a lock file another user's killed run left behind.

``exclusive_lock`` opened the lock file read-write; a stale one left by another user's run
(mode 0644 under the usual umask) made that open fail with EACCES, and a colleague resuming
the run was refused ("cannot create or lock ...: Permission denied") though nobody held it.
Root ignores file modes, so the other user is simulated: opening that file read-write fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from draftforge.files import Locked, exclusive_lock


@pytest.fixture
def foreign_lock(tmp_path, monkeypatch):
    """A stale lock file that this process may read but not write (while it is that file)."""
    path = tmp_path / ".train.lock"
    path.write_text("4242")  # the other user's run's process id: this file, not one made since
    real_open = os.open

    def open_as_another_user(file, flags, *args, **kwargs):
        try:
            foreign = os.fspath(file) == str(path) and path.read_text() == "4242"
        except FileNotFoundError:
            foreign = False
        if foreign and flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_as_another_user)
    return path


def test_a_stale_foreign_lock_file_is_replaced(foreign_lock):
    path = foreign_lock
    with exclusive_lock(path):
        assert path.read_text() == str(os.getpid())  # this user's file in its place
        with pytest.raises(Locked):  # held: another descriptor is refused
            with exclusive_lock(path):
                pass
    assert not path.exists()


def test_in_a_sticky_folder_the_stale_file_itself_is_locked(foreign_lock, monkeypatch):
    path = foreign_lock
    real_unlink = os.unlink

    def sticky(file, *args, **kwargs):
        if os.fspath(file) == str(path):
            raise PermissionError(1, "Operation not permitted", str(path))
        return real_unlink(file, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", sticky)
    with exclusive_lock(path):
        assert path.read_text() == "4242"  # the stale file itself, locked read-only
        # the holder, as /proc/locks lists it, not the dead run the stale file's text names
        with pytest.raises(Locked) as refused:
            with exclusive_lock(path):
                pass
        assert refused.value.holder == (str(os.getpid()) if Path("/proc/locks").exists() else "4242")
    assert path.exists()  # not this user's to remove


def test_a_folder_that_refuses_the_lock_file_is_an_error_not_a_loop(tmp_path, monkeypatch):
    """A read-only folder without the lock file: creating it fails (EACCES) and there is no
    file to lock read-only; the first fallback looped on that forever at full CPU."""
    path = tmp_path / ".train.lock"
    real_open = os.open

    def read_only_folder(file, flags, *args, **kwargs):
        if os.fspath(file) == str(path) and flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_folder)
    with pytest.raises(PermissionError, match="Permission denied"):
        with exclusive_lock(path):
            pass
