"""Round 34, files the user keeps: written whole, through a link, and on disk before they are trusted.

- ``write_atomic`` on a path that is a symbolic link (a calibration file or a report linked into
  a deployment folder) renamed its new file over the link: the link became a plain file and the
  file it pointed to kept the old contents, which whatever read it there went on using.
- ``llamacpp.fetch_source`` renamed the unpacked llama.cpp tree into the cache without flushing
  it, and a later fetch trusts any tree holding the converter: a power loss after the rename
  could leave empty files there for good. ``llamacpp.convert`` likewise renamed a GGUF the
  converter had not flushed over the kept one.
"""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from draftforge import files
from draftforge.eval import llamacpp
from draftforge.eval.calibration import write_calibration


@pytest.fixture()
def linked(tmp_path):
    """``deploy/cal.json`` (mode 0640, "old") and ``run/cal.json``, a relative link to it."""
    deploy, run = tmp_path / "deploy", tmp_path / "run"
    deploy.mkdir()
    run.mkdir()
    real = deploy / "cal.json"
    real.write_text("old\n")
    real.chmod(0o640)
    (run / "cal.json").symlink_to(Path("..", "deploy", "cal.json"))
    return real, run / "cal.json"


def test_write_atomic_through_a_link_replaces_the_file_it_points_to(linked, monkeypatch):
    real, link = linked
    monkeypatch.chdir(link.parent)  # a relative path, as a command line gives it
    files.write_atomic(Path("cal.json"), "new\n")
    assert link.is_symlink() and os.readlink(link) == os.path.join("..", "deploy", "cal.json")
    assert real.read_text() == "new\n" and real.stat().st_mode & 0o777 == 0o640
    assert os.listdir(link.parent) == ["cal.json"] and os.listdir(real.parent) == ["cal.json"]


def test_write_atomic_through_a_link_failing_midway_keeps_the_file(linked, monkeypatch):
    real, link = linked

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "fsync", full)  # the payload is written, its flush fails
    with pytest.raises(OSError) as caught:
        files.write_atomic(link, "new, cut short\n")
    monkeypatch.undo()
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(link)
    assert caught.value.filename2 == str(real)  # "run/cal.json -> deploy/cal.json": which file
    assert link.is_symlink() and real.read_text() == "old\n"
    assert os.listdir(link.parent) == ["cal.json"] and os.listdir(real.parent) == ["cal.json"]


def test_write_atomic_through_a_link_into_a_missing_folder_says_where_it_points(tmp_path):
    link = tmp_path / "cal.json"
    link.symlink_to(tmp_path / "gone" / "cal.json")
    with pytest.raises(FileNotFoundError) as caught:
        files.write_atomic(link, "new\n")
    assert str(caught.value).endswith(f"{str(link)!r} -> {str(tmp_path / 'gone' / 'cal.json')!r}")
    assert link.is_symlink() and os.listdir(tmp_path) == ["cal.json"]  # no folder made there


def test_calibration_written_to_a_linked_deployment_file_updates_it(linked):
    real, link = linked
    write_calibration(link, {"temperatures": [1.5, 2.0], "held_out": {"ece": 0.1}})
    assert link.is_symlink()
    assert json.loads(real.read_text()) == {"temperatures": [1.5, 2.0]}


def _recording(monkeypatch):
    """Record every fsync'd path and, at each rename, what had not been fsync'd yet under its
    source: what a power loss just after the rename could leave empty at the destination."""
    synced: set[str] = set()
    renamed: list[tuple[str, str, list[str]]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        synced.add(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def replace(src, dst):
        src = os.path.realpath(src)
        entries = [src] if os.path.isfile(src) else [
            os.path.join(root, name) for root, dirs, names in os.walk(src) for name in (*dirs, *names)] + [src]
        renamed.append((src, os.fspath(dst), sorted(e for e in entries if e not in synced)))
        real_replace(src, dst)
        synced.discard(os.path.realpath(os.path.dirname(dst)))  # its new entry: not yet on disk

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return synced, renamed


def _archive(dest: Path) -> None:
    with tarfile.open(dest / f"llama_cpp_python-{llamacpp.VERSION}.tar.gz", "w:gz") as tar:
        for name in (llamacpp.CONVERTER, "gguf-py/gguf/__init__.py"):
            data = f"# {name}\n".encode()
            member = tarfile.TarInfo(llamacpp._VENDORED + name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))


def test_fetched_llamacpp_source_is_on_disk_before_it_is_renamed_into_the_cache(tmp_path, monkeypatch):
    def pip_download(command, **kwargs):
        _archive(Path(command[command.index("--dest") + 1]))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", pip_download)
    synced, renamed = _recording(monkeypatch)
    dest = llamacpp.fetch_source(tmp_path, progress=lambda _: None)
    monkeypatch.undo()
    assert (dest / llamacpp.CONVERTER).read_text() == f"# {llamacpp.CONVERTER}\n"
    [(src, to, unsynced)] = renamed
    assert to == str(dest) and unsynced == []  # every file and folder of the tree flushed first
    assert str(dest.parent) in synced  # and the rename itself


def test_converted_gguf_is_on_disk_before_it_replaces_the_kept_one(tmp_path, monkeypatch):
    out = tmp_path / "work" / "draft-f32.gguf"
    out.parent.mkdir()
    out.write_bytes(b"GGUF earlier")

    def converter(command, **kwargs):
        Path(command[command.index("--outfile") + 1]).write_bytes(b"GGUF new")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", converter)
    synced, renamed = _recording(monkeypatch)
    assert llamacpp.convert(tmp_path, tmp_path / "export", out) == out
    monkeypatch.undo()
    assert out.read_bytes() == b"GGUF new" and os.listdir(out.parent) == ["draft-f32.gguf"]
    [(src, to, unsynced)] = renamed
    assert to == str(out) and unsynced == []
    assert str(out.parent) in synced
