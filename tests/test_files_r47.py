"""files.replace_dir when a signal's exception is raised as its first rename returns (a review
of the export path, 2026-12-06): that rename sat outside the try that moves the old folder
back, so Ctrl-C or SIGTERM there left no folder at ``out``, the old one only aside."""

from __future__ import annotations

import os

import pytest

from draftforge import files


@pytest.mark.parametrize("interrupted", ["moving the old aside", "moving the new in"])
def test_an_interrupt_as_a_rename_returns_leaves_a_whole_folder_at_out(tmp_path, monkeypatch, interrupted):
    out, staging = tmp_path / "out", tmp_path / "staging"
    out.mkdir()
    (out / "old.txt").write_text("old")
    staging.mkdir()
    (staging / "new.txt").write_text("new")
    real = os.replace
    calls = []

    def interrupt_after(src, dst):  # the rename happens; the handler's exception comes as it returns
        calls.append(src)
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
