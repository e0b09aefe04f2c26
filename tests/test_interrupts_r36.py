"""Ctrl-C or SIGTERM landing while a child process starts: ``subprocess.Popen`` raised with
the child running and nothing holding it, so the command outlived the interrupted caller
(stop 44's CI: ``make gpu-check``'s run_logged left ``sleep 60`` running). Each place that
starts a child it alone can stop now holds interrupts around the start
(:func:`draftforge.signals.interrupts_held`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from draftforge.signals import interrupts_held


class Stopped(Exception):
    pass


def _raise_stopped(signum, frame):
    raise Stopped(signum)


def test_interrupts_held_puts_signals_off_until_the_block_ends():
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    previous_int = signal.getsignal(signal.SIGINT)
    try:
        reached_end = False
        with pytest.raises(Stopped) as stopped:
            with interrupts_held():
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)  # twice: handled once
                time.sleep(0.05)  # the handler had every chance to run here
                reached_end = True
        assert reached_end and stopped.value.args == (signal.SIGTERM,)
        # the handlers are back: the same signal now raises at once
        assert signal.getsignal(signal.SIGTERM) is _raise_stopped
        assert signal.getsignal(signal.SIGINT) is previous_int
        with pytest.raises(Stopped):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        # nothing came: nothing is raised
        with interrupts_held():
            pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_interrupts_held_outside_the_main_thread_holds_nothing():
    outcome = []

    def run():
        try:
            with interrupts_held():
                outcome.append("ran")
        except BaseException as err:  # noqa: BLE001 - the test reports it
            outcome.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert outcome == ["ran"]


# A child process whose Popen gets SIGTERM after the command started, before Popen returns: the
# exact window. Its SIGTERM handler raises SystemExit, as a check child's does.
CHILD = """
import os, pathlib, signal, subprocess, sys, time
pid_file = pathlib.Path(sys.argv[1])
command = ['sh', '-c', 'echo $$ > ' + str(pid_file) + '; exec sleep 60']

def stopped(signum, frame):
    raise SystemExit(128 + signum)

signal.signal(signal.SIGTERM, stopped)
real_popen = subprocess.Popen

class InterruptedPopen(real_popen):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        deadline = time.monotonic() + 30
        while not (pid_file.is_file() and pid_file.read_text().strip()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # unheld, the handler raises here, inside "Popen"

subprocess.Popen = InterruptedPopen
tmp = pid_file.parent
which = sys.argv[2]
if which == "run_logged":
    from draftforge.splitserve import gpu_check as G
    G.run_logged(command, log=tmp / "logs" / "x.log", timeout_s=60)
elif which == "serve_and_count":
    from draftforge.splitserve import gpu_check as G
    from draftforge.splitserve import gpu_check_serving as S
    setup = G.gpu_setup(tmp, 1)
    setup.log_dir.mkdir(parents=True)
    (tmp / "draft").mkdir()
    (tmp / "draft" / "config.json").write_text('{"block_size": 8}')
    S.sglang_server_command = lambda model, draft, port, *, block_size: command
    S.serve_and_count(setup, "/models/smol", [[1, 2, 3]], time.monotonic() + 60,
                      draft_dir=tmp / "draft")
elif which == "run_stage":
    from draftforge.eval import demo_stages
    demo_stages.draftforge_command = lambda *args: command
    demo_stages.run_stage("a stage", ["x"])
elif which == "run_side_by_side":
    from draftforge.eval import demo_stages
    demo_stages.draftforge_command = lambda *args: command
    demo_stages.run_side_by_side({"a": ["x"]}, tmp / "logs", parallel=True)
print("returned", flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie nobody reaped yet has stopped running


@pytest.mark.parametrize("which", ["run_logged", "serve_and_count", "run_stage", "run_side_by_side"])
def test_a_signal_while_the_command_starts_still_stops_it(tmp_path, which):
    pid_file = tmp_path / "command.pid"
    out = tmp_path / "child.out"
    with out.open("w") as sink:  # not a pipe: a command that inherits it would hold run() open
        code = subprocess.run([sys.executable, "-c", CHILD, str(pid_file), which],
                              stdout=sink, stderr=subprocess.STDOUT, timeout=120).returncode
    output = out.read_text()
    command_pid = int(pid_file.read_text())
    try:
        deadline = time.monotonic() + 10
        while _alive(command_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(command_pid), (
            f"{which}: the command (pid {command_pid}) outlived the interrupted start; "
            f"exit {code}, output {output[-800:]}")
        # the interrupt was not swallowed: the caller stopped with it
        assert code == 128 + signal.SIGTERM, output[-800:]
        assert "returned" not in output
    finally:
        try:
            os.kill(command_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
