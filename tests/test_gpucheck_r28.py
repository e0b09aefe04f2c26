"""``make gpu-check`` on a CPU, round 28: a check interrupted while it stops a hung command
still kills that command, the time limit leaves room to stop a hung check (and counts the
start-up), and a child that ends without a result says how it ended."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from draftforge.splitserve import gpu_check as G


def test_a_check_interrupted_while_stopping_a_hung_command_still_kills_it(tmp_path):
    """A hung command that ignores SIGTERM gets SIGKILL 15 s after it; a check child's own
    SIGTERM (the parent's limit) arriving in those 15 s raised out of stop_group before the
    SIGKILL, leaving the command (in a session of its own: draftforge train, an SGLang
    server) running on the GPU after gpu-check had finished."""
    pid_file = tmp_path / "command.pid"
    hung = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)")
    script = (
        "import pathlib, signal, sys, time\n"
        "from draftforge.splitserve import gpu_check as G\n"
        "def stopped(signum, frame):\n"
        "    raise SystemExit(128 + signum)\n"
        "signal.signal(signal.SIGTERM, stopped)\n"
        # the 1 s limit can come before the command, a Python starting on a loaded machine,
        # ignores SIGTERM: the stop waits until it does (its pid file), so that it is hung
        "real_stop, real_killpg = G.stop_group, G.os.killpg\n"
        "def stop_group(proc, **kwargs):\n"
        f"    pid_file = pathlib.Path({str(pid_file)!r})\n"
        "    deadline = time.monotonic() + 60\n"
        "    while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:\n"
        "        time.sleep(0.02)\n"
        "    real_stop(proc, **kwargs)\n"
        "def killpg(pgid, signum):\n"
        "    real_killpg(pgid, signum)\n"
        "    if signum == signal.SIGTERM:  # sent: stop_group now waits out its grace\n"
        "        print('stopping', flush=True)\n"
        "G.stop_group, G.os.killpg = stop_group, killpg\n"
        f"G.run_logged([sys.executable, '-c', {hung!r}],\n"
        f"             log=pathlib.Path({str(tmp_path / 'logs' / 'x.log')!r}), timeout_s=1)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    command_pid = None
    try:
        # the command timed out and got its SIGTERM: stop_group waits out the 15 s grace
        assert proc.stdout.readline().strip() == "stopping"
        command_pid = int(pid_file.read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 5
        gone = False
        while not gone and time.monotonic() < deadline:
            try:
                os.kill(command_pid, 0)
                time.sleep(0.05)
            except ProcessLookupError:
                gone = True
        assert gone, f"the hung command (pid {command_pid}) outlived the interrupted stop"
    finally:
        proc.kill()
        proc.wait()
        if command_pid is not None:
            try:
                os.killpg(command_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


STOP_COST_S = 20.0  # stopping a hung child: SIGKILL 15 s after SIGTERM, then up to 5 s more


def test_a_hung_check_is_stopped_within_the_time_limit_start_up_included(tmp_path):
    """Each check ran until the time left, then its stop took up to 20 s more; and the limit
    started after torch's import and CUDA's start-up: `--time-limit-s 240` could take 270 s."""
    calls = []

    def runner(name, work_dir, timeout_s):
        calls.append((time.monotonic(), timeout_s))
        return G.CheckResult(name, G.PASS)

    start = time.monotonic()
    G.run_all(tmp_path, 60, emit=lambda _: None, runner=runner)
    assert calls
    assert all(at + timeout + STOP_COST_S <= start + 60 + 0.5 for at, timeout in calls)

    calls.clear()
    started = time.monotonic() - 30  # the parent's own start-up, before run_all
    G.run_all(tmp_path, 100, emit=lambda _: None, runner=runner, started=started)
    assert calls
    assert all(at + timeout + STOP_COST_S <= started + 100 + 0.5 for at, timeout in calls)


REAL_RUN_LOGGED = G.run_logged


def _child_ending(monkeypatch, code: str, tmp_path) -> G.CheckResult:
    """run_child with the check child replaced by ``code``."""
    def run_logged(command, *, log, timeout_s, **kwargs):
        return REAL_RUN_LOGGED([sys.executable, "-c", code], log=log, timeout_s=timeout_s, **kwargs)

    monkeypatch.setattr(G, "run_logged", run_logged)
    return G.run_child("export", tmp_path, 60.0)


def test_a_child_that_ends_without_a_result_says_how(tmp_path, monkeypatch):
    """A child that printed nothing and exited 0 read "the check exited with status 0; log
    X: " (a success status on a FAIL line, and a dangling colon); one killed by the OOM
    killer or a crash read "exited with status -9" / "-11"."""
    silent = _child_ending(monkeypatch, "pass", tmp_path)
    assert silent.status == G.FAIL
    assert "exited with status 0 without reporting a result" in silent.reason
    assert silent.reason.endswith("export.log: (empty)"), silent.reason

    killed = _child_ending(monkeypatch, "import os, signal; print('loading', flush=True); "
                           "os.kill(os.getpid(), signal.SIGKILL)", tmp_path)
    assert killed.status == G.FAIL
    assert "the check was killed by SIGKILL" in killed.reason and "loading" in killed.reason
    assert "status -9" not in killed.reason

    crashed = _child_ending(monkeypatch, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
                            tmp_path)
    assert "killed by SIGSEGV" in crashed.reason

    failed = _child_ending(monkeypatch, "import sys; print('Traceback: boom'); sys.exit(3)", tmp_path)
    assert "exited with status 3" in failed.reason and "boom" in failed.reason


def test_check_four_says_how_long_the_server_had_to_start(tmp_path):
    """The server gets two thirds of what fitting the draft left of check 4's limit; with
    `--time-limit-s 240` and SGLang installed that can be seconds, and the FAIL line said
    only "the server was not ready before the time limit", as if SGLang had hung."""
    from draftforge.splitserve import gpu_check_serving as S

    port = G.free_port()  # nothing listens there: a server that never gets ready
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        why = S.wait_until_ready(f"http://127.0.0.1:{port}", proc, time.monotonic() + 1.5)
        assert why is not None and re.search(r"within the [23] s the time limit left it", why), why
        why = S.wait_until_ready(f"http://127.0.0.1:{port}", proc, time.monotonic() - 5)
        assert "within the 0 s" in why and "--time-limit-s" in why, why
    finally:
        proc.kill()
        proc.wait()
