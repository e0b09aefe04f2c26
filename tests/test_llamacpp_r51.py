"""Session 51: one build of llama.cpp's tools at a time."""

from __future__ import annotations

import fcntl
import threading

from draftforge.eval import llamacpp


def test_a_second_build_waits_for_the_first_and_uses_its_tools(tmp_path, monkeypatch, capsys):
    """Two first uses (an eval llamacpp beside make llamacpp-check) configured and built into
    one folder at once, each truncating the other's log."""
    monkeypatch.setattr(llamacpp.shutil, "which", lambda tool: "/usr/bin/" + tool)
    monkeypatch.setattr(llamacpp.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("built twice")))
    results = []
    with open(tmp_path / "build.lock", "a+") as holder:
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX)  # the first build, in another process
        waiter = threading.Thread(target=lambda: results.append(llamacpp.build_tools(tmp_path, progress=lambda _: None)))
        waiter.start()
        waiter.join(timeout=2)
        assert waiter.is_alive() and not results  # it waits ...
        assert f"waiting for {tmp_path / 'build.lock'}: another process is building llama.cpp's tools" in capsys.readouterr().err
        bin_dir = tmp_path / "build" / "bin"
        bin_dir.mkdir(parents=True)
        for tool in (llamacpp.TOOL, llamacpp.TOKENIZER):  # ... while the first finishes its tools
            (bin_dir / tool).write_text("")
            (bin_dir / tool).chmod(0o755)
        fcntl.flock(holder.fileno(), fcntl.LOCK_UN)
    waiter.join(timeout=30)
    assert results == [bin_dir]  # and uses them without building
