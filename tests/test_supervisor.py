"""splitserve.supervisor: ranks started without torchrun rendezvous through a loopback-only store."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from draftforge.splitserve.supervisor import describe_status, rank_env, run_ranks

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("supervisor_worker.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")


def _listening_inodes() -> dict[int, str]:
    """inode -> local address of every listening TCP socket on this machine (from /proc/net)."""
    found = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                found[int(fields[9])] = fields[1][:width]
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _is_loopback(hex_addr: str) -> bool:
    if len(hex_addr) == 8:  # IPv4, little-endian words: 127.x.x.x ends with 7F
        return hex_addr.endswith("7F")
    return hex_addr in ("00000000000000000000000001000000",) or hex_addr.startswith(
        "0000000000000000FFFF0000") and hex_addr.endswith("7F")


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs /proc/net to list sockets")
def test_every_socket_the_job_listens_on_is_loopback(tmp_path):
    result = {}
    job = threading.Thread(target=lambda: result.update(status=run_ranks(
        [sys.executable, str(WORKER), "hold", str(tmp_path)], nproc=2, env=ENV)))
    job.start()
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"rank{r}.json").exists() for r in range(2)):
        assert job.is_alive() and time.monotonic() < deadline, result
        time.sleep(0.05)
    try:
        pids = [os.getpid()] + [json.loads((tmp_path / f"rank{r}.json").read_text())["pid"]
                                for r in range(2)]
        listening = _listening_inodes()
        mine = {inode: listening[inode] for pid in pids for inode in _socket_inodes(pid)
                if inode in listening}
        # the store (this process) and gloo's pair listeners (each rank) at least
        assert len(mine) >= 2, mine
        assert all(_is_loopback(addr) for addr in mine.values()), mine
    finally:
        (tmp_path / "release").touch()
        job.join(60)
    assert result["status"] == 0


def test_ranks_get_torchrun_environment_and_a_working_group(tmp_path):
    status = run_ranks([sys.executable, str(WORKER), "ok", str(tmp_path)], nproc=3, env=ENV)
    assert status == 0
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [r["RANK"] for r in records] == ["0", "1", "2"]
    assert {r["WORLD_SIZE"] for r in records} == {"3"}
    assert {r["MASTER_ADDR"] for r in records} == {"127.0.0.1"}
    assert {r["sum"] for r in records} == {0.0 + 1.0 + 2.0}


def test_a_failed_rank_stops_the_others_and_is_named(tmp_path):
    code = (
        "import sys; from draftforge.splitserve.supervisor import run_ranks; "
        f"sys.exit(run_ranks([sys.executable, {str(WORKER)!r}, 'fail', {str(tmp_path)!r}], nproc=2, "
        "labels={1: 'trainer rank 1'}, grace_s=1.0, term_s=1.0))"
    )
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "trainer rank 1 failed (exit status 3)" in proc.stderr
    assert "stopping rank 0 (SIGTERM)" in proc.stderr
    assert time.monotonic() - started < 60  # rank 0 blocked in a barrier forever otherwise


def _launcher(tmp_path, mode: str, **kwargs) -> subprocess.Popen:
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    code = (
        "import sys; from draftforge.splitserve.supervisor import run_ranks; "
        f"sys.exit(run_ranks([sys.executable, {str(WORKER)!r}, {mode!r}, {str(tmp_path)!r}], nproc=2, {args}))"
    )
    return subprocess.Popen([sys.executable, "-c", code], env=ENV, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_ctrl_c_stops_ranks_that_ignore_it_and_a_second_one_kills_at_once(tmp_path):
    """Ranks stuck where signals do not reach Python: SIGINT, then term_s later SIGTERM,
    then SIGKILL; the launcher exits 130 and says how to continue. A second Ctrl-C does not
    wait."""
    for second in (False, True):
        for r in range(2):
            (tmp_path / f"rank{r}.ready").unlink(missing_ok=True)
            (tmp_path / f"rank{r}.sigint").unlink(missing_ok=True)
        # the second case's term_s is long, so that waiting for it and not waiting differ by
        # far more than a loaded machine's start-up and teardown times
        proc = _launcher(tmp_path, "stubborn", term_s=30.0 if second else 2.0)
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"rank{r}.ready").exists() for r in range(2)):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        if second:
            # only once the launcher handled the first (passed it on to the ranks): sent
            # before, the two could make one signal, and the launcher wait out term_s
            while not all((tmp_path / f"rank{r}.sigint").exists() for r in range(2)):
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - started
        assert proc.returncode == 130, err
        assert "stopped on SIGINT; rerun the same command to continue" in err
        if second:
            assert took < 15.0 and "SIGTERM" not in err, (took, err)
        else:
            assert "s of SIGTERM (a rank blocked in a collective handles no signal until it returns); SIGKILL" in err and 4.0 <= took < 30, (took, err)


def test_a_rank_killed_by_a_signal_is_the_cause_over_one_that_exited_with_an_error(tmp_path):
    """Rank 1 is SIGKILLed and rank 0 exits 3 at the same moment (mostly seen in one poll):
    the status and the cause are rank 1's, and both failures are named."""
    proc = _launcher(tmp_path, "race", labels={0: "trainer rank 0", 1: "target rank 1"},
                     grace_s=10.0, term_s=1.0, poll_s=1.0)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert ("failed: target rank 1 (killed by SIGKILL), trainer rank 0 (exit status 3); "
            "the first cause is most likely target rank 1") in err


def test_a_signal_death_well_after_the_first_failure_is_not_the_cause(tmp_path):
    """Rank 0 exits 2; rank 1 aborts (SIGABRT) 3 s later, as an NCCL watchdog does after its
    peer vanished: the first failure is the cause and sets the status."""
    proc = _launcher(tmp_path, "late_abort", labels={0: "target rank 0", 1: "trainer rank 1"},
                     grace_s=10.0, term_s=1.0)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert ("failed: target rank 0 (exit status 2), trainer rank 1 (killed by SIGABRT); "
            "the first cause is most likely target rank 0") in err


def test_rank_env_and_status_descriptions():
    env = rank_env({"KEEP": "1", "RANK": "9"}, rank=2, world=4, host="127.0.0.1", port=1234)
    assert env["KEEP"] == "1" and env["RANK"] == "2" and env["LOCAL_RANK"] == "2"
    assert env["WORLD_SIZE"] == "4" and env["MASTER_PORT"] == "1234"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert describe_status(-9) == "killed by SIGKILL"
    assert describe_status(2) == "exit status 2"


# a rank that handles SIGTERM as draftforge's do (it unwinds) and whose unwinding is held up,
# as in a collective waiting for a peer: the launcher's death must SIGKILL it, not SIGTERM it
UNWINDING_SLOWLY = (
    "from draftforge.splitserve.roles import interrupt_once\n"
    "interrupt_once()\n"
    "open(PID_FILE, 'w').write(str(os.getpid()))\n"
    "try:\n"
    "    time.sleep(120)\n"
    "except KeyboardInterrupt:\n"
    "    time.sleep(120)\n"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
@pytest.mark.parametrize("body", ["open(PID_FILE, 'w').write(str(os.getpid())); time.sleep(120)\n",
                                  UNWINDING_SLOWLY], ids=["plain", "unwinding-slowly"])
def test_ranks_do_not_outlive_a_killed_launcher(tmp_path, body):
    """A launcher killed with SIGKILL (a scheduler, a test timeout, the OOM killer) takes its
    ranks with it instead of leaving them running."""
    pid_file = tmp_path / "rank.pid"
    rank = "import os, time\n" + body.replace("PID_FILE", repr(str(pid_file)))
    launcher = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from draftforge.splitserve.supervisor import run_ranks; "
         f"sys.exit(run_ranks([sys.executable, '-c', {rank!r}], nproc=1))"],
        env=ENV,
    )
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline, "the rank never started"
            time.sleep(0.1)
        rank_pid = int(pid_file.read_text())
        launcher.kill()
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{rank_pid}").exists() and _state(rank_pid) != "Z":
            assert time.monotonic() < deadline, "the rank outlived its launcher"
            time.sleep(0.1)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if pid_file.exists() and pid_file.read_text():
            with contextlib.suppress(ProcessLookupError):  # never leave a rank behind
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
def test_parent_death_hook_imports_nothing_in_the_child():
    """The hook runs between fork and exec, where an import can block forever on a lock another
    launcher thread held at the fork: everything it needs is resolved before, in the launcher.
    Checked in a throwaway process (the hook sets a death signal on whoever calls it)."""
    script = (
        "import builtins, os, sys\n"
        "from draftforge.splitserve.supervisor import die_with\n"
        "hook = die_with(os.getppid())\n"
        "def refuse(name, *args, **kwargs):\n"
        "    raise AssertionError(f'the hook imported {name}')\n"
        "builtins.__import__ = refuse\n"
        "hook()\n"
        "sys.stdout.write('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ok"


def test_a_rank_turns_the_first_sigint_into_an_interrupt_and_ignores_the_next():
    """A group-wide SIGINT reaches a rank directly and again through the launcher; the
    second one used to land in the first one's handler and print a traceback."""
    from draftforge.splitserve.roles import interrupt_once

    saved = signal.getsignal(signal.SIGINT)
    try:
        interrupt_once()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises as soon as the main thread runs Python again
        os.kill(os.getpid(), signal.SIGINT)  # the launcher's copy: ignored
        time.sleep(0.2)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, saved)
