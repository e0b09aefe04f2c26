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


@pytest.mark.parametrize("failing", ["write", "fsync", "mkstemp"])
def test_write_atomic_failure_names_the_file_and_keeps_the_errno(tmp_path, monkeypatch, failing):
    """A full disk fails the final write or fsync with no file name, and mkstemp names its
    temporary: the error names the file asked for, so a user sees which one could not be written."""
    path = tmp_path / "state.json"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if failing == "write":
        class FullFile:
            def __init__(self, fd, mode):
                self.raw = open(fd, mode)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.raw.close()

            write = flush = staticmethod(full)

            def fileno(self):
                return self.raw.fileno()

        monkeypatch.setattr(files.os, "fdopen", FullFile)
    elif failing == "fsync":
        monkeypatch.setattr(files.os, "fsync", full)
    else:
        def mkstemp(*, prefix, suffix, dir):
            raise PermissionError(errno.EACCES, "Permission denied", os.path.join(dir, prefix + "x" + suffix))

        monkeypatch.setattr(files.tempfile, "mkstemp", mkstemp)
    with pytest.raises(OSError) as caught:
        files.write_atomic(path, b"new")
    monkeypatch.undo()
    wanted = errno.EACCES if failing == "mkstemp" else errno.ENOSPC
    assert caught.value.errno == wanted and caught.value.filename == str(path)
    assert str(caught.value) == f"[Errno {wanted}] {os.strerror(wanted)}: {str(path)!r}"
    assert isinstance(caught.value, PermissionError) == (failing == "mkstemp")
    assert os.listdir(tmp_path) == []  # no temporary left behind


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


def _old_out_and_new_staging(tmp_path):
    """``out`` holding old.txt and ``staging`` holding new.txt, for replace_dir."""
    out, staging = tmp_path / "out", tmp_path / "staging"
    out.mkdir()
    (out / "old.txt").write_text("old")
    staging.mkdir()
    (staging / "new.txt").write_text("new")
    return out, staging


def test_replace_dir_puts_the_old_folder_back_when_the_new_one_cannot_go_in(tmp_path, monkeypatch):
    out, staging = _old_out_and_new_staging(tmp_path)
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



@pytest.mark.parametrize("interrupted", ["moving the old aside", "moving the new in"])
def test_an_interrupt_as_a_rename_returns_leaves_a_whole_folder_at_out(tmp_path, monkeypatch, interrupted):
    """The first rename (the old folder moved aside) sat outside the try that moves it back, so
    Ctrl-C or SIGTERM raised as it returned left no folder at ``out`` (2026-12-06)."""
    out, staging = _old_out_and_new_staging(tmp_path)
    real = os.replace

    def interrupt_after(src, dst):  # the rename happens; the handler's exception comes as it returns
        real(src, dst)
        if (interrupted == "moving the old aside") == (os.fspath(src) == os.fspath(out)):
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupt_after)
    with pytest.raises(KeyboardInterrupt):
        files.replace_dir(staging, out)
    monkeypatch.undo()
    # the old folder back in place, or the new one whole where its rename had completed
    expected = ["old.txt"] if interrupted == "moving the old aside" else ["new.txt"]
    assert sorted(os.listdir(out)) == expected
    left = ["out", "staging"] if interrupted == "moving the old aside" else ["out"]
    assert sorted(os.listdir(tmp_path)) == left  # nothing retired is left behind

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


def _full_disk_on_rename(monkeypatch):
    def full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full)


def test_the_training_plot_on_a_full_disk_leaves_no_temporary(tmp_path, monkeypatch):
    from draftforge.train.plots import plot_slot_acceptance

    path = tmp_path / "slot_acceptance.png"
    _full_disk_on_rename(monkeypatch)
    with pytest.raises(OSError) as caught:
        plot_slot_acceptance(path, final=[0.9, 0.7, 0.5], tau=2.1)
    monkeypatch.undo()
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(path)
    assert os.listdir(tmp_path) == []
    assert plot_slot_acceptance(path, final=[0.9, 0.7, 0.5], tau=2.1) == path
    assert path.read_bytes().startswith(b"\x89PNG") and os.listdir(tmp_path) == [path.name]


def test_the_evaluation_plots_on_a_full_disk_leave_no_temporary(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from draftforge.eval.report import _save

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = tmp_path / "acceptance_length.png"
    try:
        _full_disk_on_rename(monkeypatch)
        with pytest.raises(OSError) as caught:
            _save(fig, path)
        monkeypatch.undo()
        assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(path)
        assert os.listdir(tmp_path) == []
        assert _save(fig, path) == path
    finally:
        plt.close(fig)
    assert path.read_bytes().startswith(b"\x89PNG") and os.listdir(tmp_path) == [path.name]


def test_the_umask_is_read_without_changing_it(umask_027, monkeypatch):
    """Setting the umask to read it leaves it 0 for a moment to other threads: on Linux it is
    read from /proc/self/status, never set."""
    from draftforge import files

    def no_setting(mask):
        raise AssertionError(f"os.umask({mask:o}) called")

    monkeypatch.setattr(files.os, "umask", no_setting)
    assert files._umask() == 0o027
