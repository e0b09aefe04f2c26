"""Atomic writes (draftforge.files): modes under the umask, whole-or-old files, folder replacement."""

from __future__ import annotations

import errno
import os

import pytest

from draftforge import files


@pytest.fixture()
def umask_027():
    old = os.umask(0o027)
    yield 0o027
    os.umask(old)


def test_write_atomic_gives_the_umask_mode_not_mkstemps_0600(tmp_path, umask_027):
    path = tmp_path / "sub" / "config.yaml"
    files.write_atomic(path, b"a: 1\n")
    assert path.read_bytes() == b"a: 1\n"
    assert path.stat().st_mode & 0o777 == 0o640
    assert sorted(os.listdir(path.parent)) == ["config.yaml"]


def test_write_atomic_failure_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    path.write_bytes(b"old")

    def broken(src, dst):
        raise OSError(errno.ENOSPC, "simulated full disk")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="simulated full disk"):
        files.write_atomic(path, b"new")
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["state.json"]


def test_shareable_walks_a_folder(tmp_path, umask_027):
    folder = tmp_path / "export"
    (folder / "nested").mkdir(parents=True)
    (folder / "nested" / "a.bin").write_bytes(b"x")
    (folder / "b.json").write_text("{}")
    for path in (folder, folder / "nested"):
        path.chmod(0o700)
    for path in (folder / "nested" / "a.bin", folder / "b.json"):
        path.chmod(0o600)
    files.shareable(folder)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [folder, *folder.rglob("*")]}
    assert modes == {"export": 0o750, "nested": 0o750, "a.bin": 0o640, "b.json": 0o640}


def test_replace_dir_puts_the_old_folder_back_when_the_new_one_cannot_go_in(tmp_path, monkeypatch):
    out, staging = tmp_path / "out", tmp_path / "staging"
    out.mkdir()
    (out / "old.txt").write_text("old")
    staging.mkdir()
    (staging / "new.txt").write_text("new")
    real = os.replace

    def fail_for_staging(src, dst):
        if os.fspath(src) == os.fspath(staging):
            raise OSError(errno.EIO, "simulated rename failure")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", fail_for_staging)
    with pytest.raises(OSError, match="simulated rename failure"):
        files.replace_dir(staging, out)
    monkeypatch.undo()
    assert sorted(os.listdir(out)) == ["old.txt"]
    assert sorted(os.listdir(tmp_path)) == ["out", "staging"]  # nothing retired is left behind

    files.replace_dir(staging, out)
    assert sorted(os.listdir(out)) == ["new.txt"]
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_fsync_tree_reads_every_file_it_flushes(tmp_path, monkeypatch):
    (tmp_path / "a" / "b").mkdir(parents=True)
    for name in ("a/x", "a/b/y", "z"):
        (tmp_path / name).write_bytes(b"1")
    synced = []
    real = os.fsync

    def recording(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    files.fsync_tree(tmp_path)
    names = {os.path.relpath(p, tmp_path) for p in synced}
    assert {"a/x", "a/b/y", "z"} <= names
    assert {".", "a", "a/b"} <= names  # each folder's entries too
