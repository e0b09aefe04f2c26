"""Session 63: a full standard output is an error naming it in every command.

Only commands printing through ``write_output`` were covered. A command's own ``print`` that
failed (a full disk) raised an OSError the handler let through, and the check after it flushed
standard output again to tell whose it was: that flush succeeded (the failed write drops its
buffer), so the command ended with a traceback and status 1 (``eval compare``, ``export``,
``eval``, ``bench train`` ...)."""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_eval_compare import _write

from draftforge import cli

ROOT = Path(__file__).resolve().parents[1]
NO_SPACE = os.strerror(errno.ENOSPC)


@pytest.mark.parametrize("unbuffered", [False, True])
def test_a_full_output_of_a_commands_own_print_is_an_error_naming_it(tmp_path, unbuffered):
    a, b = _write(tmp_path / "a"), _write(tmp_path / "b")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:  # every print writes at once: it fails inside the command
        env["PYTHONUNBUFFERED"] = "1"
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "draftforge", "eval", "compare", str(a), str(b)],
                              cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True, env=env,
                              timeout=300, check=False)
    assert (done.returncode, done.stderr) == (2, f"draftforge eval compare: error: standard output: {NO_SPACE}\n")


class _Failing(io.StringIO):
    def __init__(self, exc: OSError) -> None:
        super().__init__()
        self.exc = exc

    def write(self, text: str) -> int:
        raise self.exc


def test_the_guard_names_a_failed_write_and_leaves_a_reader_gone_alone(monkeypatch):
    monkeypatch.setattr(cli, "_discard_stdout", lambda: None)  # no descriptor to point elsewhere
    monkeypatch.setattr(sys, "stdout", _Failing(OSError(errno.ENOSPC, NO_SPACE)))
    with cli._guarded_stdout():
        with pytest.raises(cli.OutputError, match=f"^standard output: {NO_SPACE}$"):
            print("table")
    assert isinstance(sys.stdout, _Failing)  # put back
    monkeypatch.setattr(sys, "stdout", _Failing(BrokenPipeError(errno.EPIPE, "Broken pipe")))
    with cli._guarded_stdout():
        with pytest.raises(BrokenPipeError):
            print("table")
        assert sys.stdout.isatty() is False  # everything else is the stream's own
