"""The command line and launcher, round 15: a reader that stops reading, torchrun killed by a
signal, an output folder that cannot be written, HOST:PORT given as an address, and the
dry run's per-node commands with --max-restarts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from draftforge import cli

ROOT = Path(__file__).resolve().parents[1]
TWO_NODE = "recipes/ling3-flash-2node.yaml"


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``draftforge ARGV`` (argparse's own exits included)."""
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


# --------------------------------------------------------------------------- a closed pipe


def test_output_into_a_reader_that_stopped_reading_ends_quietly_as_sigpipe(monkeypatch):
    """``draftforge train R --dry-run | head`` printed a BrokenPipeError traceback and exited 1
    (or 120, "Exception ignored", when the write came at exit); now nothing is printed and the
    status is a SIGPIPE death's, 128 + 13, as a shell reports ``yes | head``'s."""
    proc = subprocess.Popen([sys.executable, "-m", "draftforge", "config", "show", "recipes/tiny-debug.yaml"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first write
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE == 141, err
    assert err == ""
    # a broken pipe of the command's own, with its standard output still read, is not hidden
    monkeypatch.setattr(cli, "_load", lambda handler: _raise_broken_pipe)
    read, write = os.pipe()
    try:
        with open(write, "w", closefd=False) as stdout:
            monkeypatch.setattr(sys, "stdout", stdout)
            with pytest.raises(BrokenPipeError):
                cli.main(["config", "keys"])
    finally:
        os.close(read)
        os.close(write)


def _raise_broken_pipe(argv):
    raise BrokenPipeError(32, "Broken pipe")  # a worker's pipe, say


# --------------------------------------------------------------------------- torchrun's status


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_node_whose_torchrun_was_killed_exits_128_plus_the_signal(signum):
    """torchrun killed (SIGKILL by the out-of-memory killer): Popen's -9 was returned as the
    job's status, printed as "exit status -9" and left the process with status 247 (-9 mod
    256); a one-machine job's killed rank already gave 128 + 9."""
    from draftforge.splitserve.launch import run_torchrun

    command = [sys.executable, "-c", f"import os; os.kill(os.getpid(), {int(signum)})"]
    assert run_torchrun(command, env=os.environ) == 128 + int(signum)
    assert run_torchrun([sys.executable, "-c", "raise SystemExit(3)"], env=os.environ) == 3


# --------------------------------------------------------------------------- train.output_dir


def _unwritable() -> Path:
    """/sys: no folder can be made there, not even by root."""
    if not sys.platform.startswith("linux") or not Path("/sys").is_dir():
        pytest.skip("needs Linux's /sys")
    try:
        tempfile.TemporaryDirectory(dir="/sys").cleanup()
    except OSError:
        return Path("/sys")
    pytest.skip("/sys is writable here")


def test_an_output_dir_that_cannot_be_written_is_refused_before_the_job_starts(tmp_path, capsys,
                                                                               monkeypatch):
    """The job started, the target loaded, and trainer rank 0's first write ended it with a
    PermissionError traceback, exit status 1 (and restarts with split.restart_target)."""
    from splitserve_helpers import tiny_recipe

    root = _unwritable()
    run_dir = root / "draftforge-r15" / "run"
    recipe = tiny_recipe(tmp_path, overrides={"train.output_dir": str(run_dir)})
    started = []
    monkeypatch.setattr("draftforge.splitserve.launch.run_ranks", lambda *a, **k: started.append(1) or 0)
    for extra in (["--dry-run"], []):
        code, _, err = _run(["train", recipe, *extra], capsys)
        assert code == 2 and started == [], err
        assert err == (f"draftforge train: error: train.output_dir: {run_dir}: cannot write in {root} "
                       "(Operation not permitted); name a folder this machine can write for the run\n")
    # a writable one passes, and the check leaves nothing behind
    before = sorted(os.listdir(tmp_path))
    code, out, err = _run(["train", recipe, f"train.output_dir={tmp_path / 'run'}", "--dry-run"], capsys)
    assert code == 0, err
    assert sorted(os.listdir(tmp_path)) == before


# --------------------------------------------------------------------------- --master-addr HOST:PORT


@pytest.mark.parametrize("address", ["10.0.0.1:29500", "[fd00::1]:29500", "node0:29500"])
def test_a_master_addr_with_a_port_is_refused(address, capsys):
    """10.0.0.1:29500 was taken as a host: every node's torchrun waited for a node 0 at
    '10.0.0.1:29500' until its rendezvous timeout (and a one-machine job said "Name or service
    not known")."""
    code, out, err = _run(["train", TWO_NODE, "--dry-run", "--master-addr", address], capsys)
    assert code == 2 and out == ""
    assert err.endswith(
        f"draftforge train: error: argument --master-addr: {address!r} is no address: give the host "
        "alone (an IPv6 address as is or in [brackets]) and node 0's port with --master-port\n"), err


@pytest.mark.parametrize("address", ["fd00::1", "[fd00::1]", "fe80::1%eth0"])
def test_an_ipv6_master_addr_is_still_taken(address, capsys):
    code, out, err = _run(["train", TWO_NODE, "--dry-run", "--master-addr", address], capsys)
    bare = address.strip("[]")
    assert code == 0, err
    assert f"  on node 1: draftforge train {TWO_NODE} --node-rank 1 --master-addr {bare}\n" in out


# --------------------------------------------------------------------------- the dry run's commands


def test_each_nodes_command_in_the_dry_run_keeps_max_restarts(capsys):
    """The dry run prints the command to run on every node; it dropped --max-restarts, so a job
    started by copying them ran without the restarts asked for."""
    args = ["--master-addr", "10.0.0.5", "--master-port", "29600", "--max-restarts", "2"]
    code, out, err = _run(["train", TWO_NODE, "train.steps=5", "--dry-run", *args], capsys)
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("  on node ")]
    assert lines == [
        f"  on node {n}: draftforge train {TWO_NODE} train.steps=5 --node-rank {n} --master-addr "
        "10.0.0.5 --master-port 29600 --max-restarts 2" for n in (0, 1)
    ]
    # without the option the commands stay as they were
    code, out, err = _run(["train", TWO_NODE, "--dry-run", "--master-addr", "10.0.0.5"], capsys)
    assert f"  on node 0: draftforge train {TWO_NODE} --node-rank 0 --master-addr 10.0.0.5\n" in out


# --------------------------------------------------------------------------- a second Ctrl-C, several nodes

# torchrun as it stops: its ranks run in sessions of their own (torch's SubprocessHandler,
# start_new_session), and after the first signal it waits up to 30 s for them to stop. This
# rank ignores SIGTERM and SIGINT, as one stuck in a collective does.
_FAKE_TORCHRUN = """
import signal, subprocess, sys, time
def stopping(signum, frame):
    open(sys.argv[1] + ".stopping", "w").close()  # the launcher passed the first signal on
    rank.terminate()
    time.sleep(60)
signal.signal(signal.SIGTERM, stopping)
signal.signal(signal.SIGINT, stopping)
rank = subprocess.Popen([sys.executable, "-c", "import os, signal, sys, time\\n"
                         "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
                         "signal.signal(signal.SIGINT, signal.SIG_IGN)\\n"
                         "open(sys.argv[1], 'w').write(str(os.getpid()))\\n"  # ready
                         "time.sleep(120)", sys.argv[1]], start_new_session=True)
time.sleep(120)
"""


def _state(pid: int) -> str | None:
    """The process's state letter (Z: dead, not yet reaped), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def test_a_second_signal_kills_the_ranks_of_torchrun_not_only_torchrun(tmp_path):
    """Ctrl-C twice on a node of a multi-node job killed torchrun only: its ranks, in sessions
    of their own, went on running (holding their GPUs and the rendezvous ports) as orphans."""
    import threading
    import time

    from draftforge.splitserve.launch import run_torchrun
    from draftforge.splitserve.supervisor import JobInterrupted

    if not Path("/proc/self/stat").exists():
        pytest.skip("needs Linux's /proc")
    pid_file = tmp_path / "rank.pid"
    stopping = tmp_path / "rank.pid.stopping"

    def signal_twice() -> None:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
        # the second only once the launcher handled the first (torchrun got it): sent before,
        # the two could make one signal, as if the user had pressed Ctrl-C once
        while not stopping.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_twice, daemon=True).start()
    with pytest.raises(JobInterrupted) as stop:
        run_torchrun([sys.executable, "-c", _FAKE_TORCHRUN, str(pid_file)], env=os.environ)
    rank = int(pid_file.read_text())
    try:
        assert stop.value.code == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while _state(rank) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(rank) in (None, "Z"), "torchrun's rank outlived it"
    finally:
        if _state(rank) not in (None, "Z"):
            os.kill(rank, signal.SIGKILL)
