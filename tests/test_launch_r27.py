"""Review round 27 of the launcher (``draftforge train``): splitserve.launch, supervisor and
multinode."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ENV = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")

# rank 0 ignores SIGINT and SIGTERM (a rank stuck in a collective with a dead peer); rank 1
# fails with status 3 once rank 0 is ready
STUCK_AND_FAILING = (
    "import os, signal, sys, time\n"
    "out = sys.argv[1]\n"
    "rank = int(os.environ['RANK'])\n"
    "if rank == 0:\n"
    "    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "    open(os.path.join(out, 'rank0.pid'), 'w').write(str(os.getpid()))\n"
    "    time.sleep(600)\n"
    "deadline = time.monotonic() + 60\n"
    "while not os.path.exists(os.path.join(out, 'rank0.pid')) and time.monotonic() < deadline:\n"
    "    time.sleep(0.02)\n"
    "os._exit(3)\n"
)


def _wait_for(predicate, what: str, timeout: float, launcher: subprocess.Popen | None = None) -> None:
    """Until ``predicate()``; fails after ``timeout`` s, or at once when ``launcher`` ended."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        assert launcher is None or launcher.poll() is None, f"{what}: the launcher ended"
        time.sleep(0.05)


def _node(tmp_path: Path, torchrun: list[str], err) -> subprocess.Popen:
    """``draftforge train`` as node 0 of a two-node recipe of 2 ranks per node, in a process of
    its own, its torchrun running ``torchrun`` instead (the ranks of one machine, no node 1)."""
    from splitserve_helpers import free_port, tiny_recipe

    recipe = tiny_recipe(tmp_path, trainers=3, overrides={"split.num_nodes": 2})
    args = [str(recipe), "--node-rank", "0", "--master-addr", "10.0.0.5", "--master-port", str(free_port())]
    code = ("import sys; from draftforge.splitserve import launch; "
            f"launch.multinode_torchrun_command = lambda *a, **k: {torchrun!r}; "
            f"sys.exit(launch.main({args!r}))")
    return subprocess.Popen([sys.executable, "-c", code], env=ENV, stdin=subprocess.DEVNULL,
                            stdout=err, stderr=err, text=True)


def _kill_pid_in(path: Path) -> None:
    if path.exists() and path.read_text():
        try:
            os.kill(int(path.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_on_a_node_whose_rank_failed_kills_its_ranks_at_once(tmp_path):
    """A node's rank failed; torchrun SIGTERMs the others and waits for them up to its own
    grace (30 s), and a Ctrl-C then (forwarded to torchrun) made it start that wait again with
    SIGINT (its --shutdown-timeout): the node stopped only a grace later, where a one-machine
    job is killed at once. Now the first signal after a rank ended kills what is left."""
    rank = tmp_path / "rank.py"
    rank.write_text(STUCK_AND_FAILING)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "--shutdown-timeout=60", str(rank), str(tmp_path)]
    err_path = tmp_path / "launcher.err"
    with open(err_path, "w") as err:
        launcher = _node(tmp_path, torchrun, err)
    try:
        # torchrun's log of its stop: rank 1 failed, and rank 0 got SIGTERM
        _wait_for(lambda: "closing signal SIGTERM" in err_path.read_text(), "rank 1 never failed", 90, launcher)
        launcher.send_signal(signal.SIGINT)
        try:
            launcher.wait(timeout=25)  # before: 60 s, torchrun's --shutdown-timeout
        except subprocess.TimeoutExpired:
            pytest.fail("the node waited for torchrun's grace after Ctrl-C\n" + err_path.read_text()[-3000:])
        rank0 = int((tmp_path / "rank0.pid").read_text())
        _wait_for(lambda: not Path(f"/proc/{rank0}").exists(), "the stuck rank outlived its node", 10)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        _kill_pid_in(tmp_path / "rank0.pid")  # never leave the stuck rank behind
    err = err_path.read_text()
    assert launcher.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "draftforge train: stopped on SIGINT after a rank of this node ended" in err, err[-3000:]


# both ranks note a SIGINT in a file and exit 130, as draftforge's ranks do on Ctrl-C
INTERRUPTIBLE = (
    "import os, signal, sys, time\n"
    "out, rank = sys.argv[1], os.environ['RANK']\n"
    "def interrupted(signum, frame):\n"
    "    open(os.path.join(out, 'interrupted' + rank), 'w').close()\n"
    "    os._exit(130)\n"
    "signal.signal(signal.SIGINT, interrupted)\n"
    "open(os.path.join(out, 'ready' + rank), 'w').close()\n"
    "time.sleep(600)\n"
)


@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_on_a_node_whose_ranks_all_run_still_reaches_them(tmp_path):
    """The other side of the above: with every rank running, the first Ctrl-C is passed on
    (each rank gets it and stops as it will), nothing is killed."""
    rank = tmp_path / "rank.py"
    rank.write_text(INTERRUPTIBLE)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                str(rank), str(tmp_path)]
    err_path = tmp_path / "launcher.err"
    with open(err_path, "w") as err:
        launcher = _node(tmp_path, torchrun, err)
    try:
        _wait_for(lambda: (tmp_path / "ready0").exists() and (tmp_path / "ready1").exists(),
                  "the ranks never started", 90, launcher)
        launcher.send_signal(signal.SIGINT)
        launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    err = err_path.read_text()
    assert launcher.returncode == 128 + signal.SIGINT, err[-3000:]
    assert (tmp_path / "interrupted0").exists() and (tmp_path / "interrupted1").exists(), err[-3000:]
    assert "draftforge train: stopped on SIGINT; " in err, err[-3000:]


def test_node_0_refuses_a_rendezvous_port_in_use_before_anything_starts(tmp_path, monkeypatch):
    """Something listened on node 0's --master-port (another job, a torchrun left running):
    torchrun ended in a DistNetworkError traceback (EADDRINUSE), the launcher said "the job
    failed (exit status 1)" and restarted it with split.restart_target, each time the same
    way. Now node 0 refuses the port at once, naming it and the option; a port whose last
    connection waits in TIME_WAIT is free (the store reuses it)."""
    from splitserve_helpers import tiny_recipe

    from draftforge.errors import InputError
    from draftforge.splitserve import launch

    recipe = tiny_recipe(tmp_path, overrides={"split.num_nodes": 2, "split.restart_target": True})
    started = []
    monkeypatch.setattr(launch, "run_torchrun", lambda *a, **k: started.append(a) or 0)
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store: no help
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(InputError) as refused:
            launch.main([str(recipe), "--node-rank", "0", "--master-addr", "10.0.0.5",
                         "--master-port", str(port)])
        assert str(refused.value).startswith(f"--master-port {port}: "), refused.value
        assert "pass a free port with --master-port, the same on every node" in str(refused.value)
        assert not started
        # node 1 listens on nothing: its torchrun connects to node 0
        assert launch.main([str(recipe), "--node-rank", "1", "--master-addr", "10.0.0.5",
                            "--master-port", str(port)]) == 0
        assert len(started) == 1
        # the store's last connection closed by its side: TIME_WAIT, then no listener
        with socket.create_connection(("127.0.0.1", port)) as client:
            served, _ = held.accept()
            served.close()  # the server side closes first: its end of the connection waits
            client.recv(1)
    assert launch.main([str(recipe), "--node-rank", "0", "--master-addr", "10.0.0.5",
                        "--master-port", str(port)]) == 0
    assert len(started) == 2
