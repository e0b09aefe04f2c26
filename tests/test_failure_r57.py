"""Who is blamed when a peer hangs.

gloo, when one receive or send times out, closes every connection of that process group in
the process: each other op over the group, pending or later, fails at once with "Application
timeout caused pair closure", naming its own peer, a live one as well. The wire must name the
silent peer (the one whose own op timed out), on the target's ack listener (one thread per
trainer), on a trainer's acknowledgement link (its heartbeat thread and its main thread), on a
target's data links (its pulse and its main thread) and in a trainer's drain of its other
producers. Each case is a 3-process gloo job with a 2 s timeout: rank 0 under test, rank 1
alive, rank 2 silent.

The launcher, after a hang: the hung rank never exits by itself, and the ranks that give up on
it exit with the lost-peer status; the summary names the rank it had to kill.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from draftforge.splitserve import supervisor
from draftforge.splitserve import transport as T

TIMEOUT_S = 2.0  # the process groups' timeout in the gloo job


# --------------------------------------------------------------------------- without processes


def test_a_pair_closure_is_reported_as_the_timeout_that_caused_it():
    """The closure (a live peer's op) comes before the timeout's own error, as in gloo: the
    former waits for the latter, and names its peer."""
    group = object()  # a group of its own: nothing else in this process records a timeout on it
    got = {}

    def closed() -> None:
        got["closure"] = T._peer_died(1, group, "trainer", "waiting for credits from trainer rank 1",
                                      RuntimeError("Application timeout caused pair closure"))

    thread = threading.Thread(target=closed)
    thread.start()
    time.sleep(0.3)
    timeout = T._peer_died(2, group, "trainer", "waiting for credits from trainer rank 2",
                           RuntimeError("Timed out waiting 2000ms for recv operation to complete"))
    thread.join(10)
    assert timeout.rank == 2 and not timeout.side_effect
    assert got["closure"].rank == 2 and got["closure"] is not timeout
    assert str(got["closure"]) == str(timeout)
    assert "trainer rank 2 sent nothing within the timeout" in str(got["closure"])
    # a later op over the closed group: the same, at once
    started = time.monotonic()
    later = T._peer_died(1, group, "trainer", "telling it to stop",
                         RuntimeError("Application timeout caused pair closure"))
    assert later.rank == 2 and time.monotonic() - started < 1.0


def test_a_pair_closure_without_its_timeout_stays_a_side_effect(monkeypatch):
    monkeypatch.setattr(T, "SIDE_EFFECT_WAIT_S", 0.1)
    died = T._peer_died(1, object(), "target", "returning credits",
                        RuntimeError("Application timeout caused pair closure"))
    assert died.rank == 1 and died.side_effect


def _listener(heard: dict[int, float]) -> T.AckListener:
    listener = T.AckListener([], group=None)  # no thread: the state is set by hand
    listener.srcs = sorted(heard)
    listener.consumed = dict.fromkeys(heard, 0)
    listener.heard = dict(heard)
    return listener


def test_the_ack_listener_blames_the_trainer_silent_longest_for_a_lone_pair_closure():
    now = time.monotonic()
    listener = _listener({1: now - 0.5, 2: now - 30.0})
    closure = T.PeerDied(1, "trainer", "waiting for credits from trainer rank 1",
                         "Application timeout caused pair closure")
    assert closure.side_effect
    listener.fail(closure)
    assert listener.error.rank == 2 and not listener.error.side_effect
    assert "trainer rank 2 sent nothing within the timeout" in str(listener.error)
    listener.fail(T.PeerDied(1, "trainer", "x", "Connection closed by peer"))
    assert listener.error.rank == 2  # the first one wins


def test_the_ack_listener_keeps_a_real_error_over_a_pair_closure():
    now = time.monotonic()
    listener = _listener({1: now - 30.0, 2: now - 0.5})  # the closure's own peer is the silent one
    listener.fail(T.PeerDied(1, "trainer", "x", "Application timeout caused pair closure"))
    assert listener.error.rank == 1 and listener.error.side_effect
    listener.fail(T.PeerDied(2, "trainer", "y", "Timed out waiting 2000ms for recv operation"))
    assert listener.error.rank == 2


# --------------------------------------------------------------------------- a gloo job


def _sample(dst: int, group, seq_no: int) -> None:
    import torch

    T.send_sample(dst, f"s{seq_no}", torch.arange(4), torch.ones(4, dtype=torch.bool),
                  torch.zeros(4, 2), torch.zeros(4, 2), seq_no=seq_no, group=group)


def _until_error(call, seconds: float = 15.0) -> T.PeerDied | None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            call()
        except T.PeerDied as exc:
            return exc
        time.sleep(0.05)
    return None


def _ack_listener(rank: int, group) -> dict:
    """Target (rank 0): one listening thread per trainer; trainer 1 beats, trainer 2 is silent."""
    if rank == 0:
        listener = T.AckListener([1, 2], group=group)
        with listener.cond:
            listener.cond.wait_for(lambda: listener.error is not None, timeout=30)
        return {"error": [getattr(listener.error, "rank", None), str(listener.error)]}
    if rank == 1:
        _until_error(lambda: T.send_ack(0, 0, group=group), seconds=3 * TIMEOUT_S)
    return {}


def _ack_link(rank: int, group) -> dict:
    """Trainer (rank 0): a heartbeat to both producers, credits to producer 1 from the main
    thread; producer 1 listens, producer 2 never does."""
    if rank == 0:
        link = T.AckLink([1, 2], group=group, every_s=0.3)
        count = [0]

        def ack() -> None:
            link.check()
            count[0] += 1
            link.ack(1, count[0])

        main = _until_error(ack)
        try:
            link.stop()
            stop = None
        except T.PeerDied as exc:
            stop = exc
        return {"error": [getattr(main, "rank", None), str(main)],
                "stop": [getattr(stop, "rank", None), str(stop)]}
    if rank == 1:
        listener = T.AckListener([0], group=group)
        with listener.cond:
            listener.cond.wait_for(lambda: listener.error is not None, timeout=30)
    return {}


def _pulse(rank: int, group) -> dict:
    """Target (rank 0): a pulse to both trainers, samples to trainer 1 from the main thread;
    trainer 1 receives, trainer 2 never does."""
    if rank == 0:
        pulse = T.Pulse(every_s=0.3, group=group)
        pulse.expect([1, 2])
        seq = [0]

        def send() -> None:
            with pulse.lock:
                _sample(1, group, seq[0])
            seq[0] += 1

        main = _until_error(send)
        pulse.close()
        return {"error": [getattr(main, "rank", None), str(main)]}
    if rank == 1:
        _until_error(lambda: T.recv_sample(0, group=group))
    return {}


def _drain(rank: int, group) -> dict:
    """Trainer (rank 0) fed by producers 1 and 2 in turn: 1 sends a sample (then its end),
    2 nothing; after the timeout on 2, the drain of 1 must not report 1."""
    if rank == 0:
        receiver = T.SampleReceiver([1, 2], credits=2, group=group)
        first = receiver.get(max_wait_s=20)
        try:
            receiver.get(max_wait_s=20)
            error = None
        except T.PeerDied as exc:
            error = exc
        _, lost = receiver.drain_rest()
        return {"first": first[0] if isinstance(first, tuple) else None,
                "error": [getattr(error, "rank", None), str(error)],
                "lost": [[exc.rank, str(exc)] for exc in lost]}
    if rank == 1:
        try:
            _sample(0, group, 0)
            T.send_end(0, group=group)
        except T.PeerDied:
            pass
    return {}


CASES = {"ack_listener": _ack_listener, "ack_link": _ack_link, "pulse": _pulse, "drain": _drain}


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    for name, case in CASES.items():
        # a group of its own: the timeout closes its connections, not the next case's
        group = dist.new_group([0, 1, 2], timeout=datetime.timedelta(seconds=TIMEOUT_S))
        results[name] = case(rank, group)
        dist.barrier()  # on the world group, untouched by the case's timeout
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)  # the broken groups' teardown is of no interest


@pytest.fixture(scope="module")
def gloo_job(tmp_path_factory):
    from splitserve_helpers import free_port

    out = tmp_path_factory.mktemp("failure_r57") / "results.json"
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    procs = [subprocess.Popen([sys.executable, __file__, str(rank), str(port), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(3)]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=150)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [proc.returncode for proc in procs] == [0, 0, 0], logs
    return json.loads(out.read_text())


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["ack_listener", "ack_link", "pulse"])
def test_the_silent_rank_is_named_not_the_live_one(gloo_job, case):
    rank, message = gloo_job[case]["error"]
    assert rank == 2, message
    assert "rank 2 sent nothing within the timeout" in message, message


@pytest.mark.distributed
def test_a_trainers_stop_after_a_timeout_names_the_silent_producer(gloo_job):
    rank, message = gloo_job["ack_link"]["stop"]
    assert rank == 2, message


@pytest.mark.distributed
def test_the_drain_after_a_silent_producer_does_not_report_the_live_one(gloo_job):
    result = gloo_job["drain"]
    assert result["first"] == 1
    assert result["error"][0] == 2, result
    assert all(rank == 2 for rank, _ in result["lost"]), result


# --------------------------------------------------------------------------- the launcher


def _name(rank: int) -> str:
    return {0: "target rank 0"}.get(rank, f"trainer rank {rank}")


def test_lost_peer_status_is_the_ranks():
    from draftforge.splitserve.roles import EXIT_PEER_DIED

    assert supervisor.LOST_PEER_STATUS == EXIT_PEER_DIED


def test_after_a_hang_the_rank_the_launcher_had_to_kill_is_the_likely_cause():
    """A SIGSTOPped target: both trainers give up on it (exit status 3), the launcher kills it."""
    line, status = supervisor.failure_summary(
        {1: 3, 2: 3}, {1: 10.0, 2: 10.2}, {0: (-9, True)}, name=_name)
    assert line == (
        "failed: trainer rank 1 (exit status 3), trainer rank 2 (exit status 3), target rank 0 "
        "(did not stop by itself: killed by SIGKILL after SIGTERM); the first cause is most likely "
        "target rank 0: the ranks that failed all reported a lost peer (exit status 3), and it had "
        "to be killed (a hung rank?)")
    assert status == 3  # the first failure's
    # one trainer: said too, though only one rank failed
    line, status = supervisor.failure_summary({1: 3}, {1: 10.0}, {0: (-9, True)}, name=_name)
    assert line.endswith("the first cause is most likely target rank 0: the ranks that failed all "
                         "reported a lost peer (exit status 3), and it had to be killed (a hung rank?)")
    # the one that needed SIGKILL goes before one SIGTERM stopped
    line, _ = supervisor.failure_summary({1: 3}, {1: 10.0}, {0: (-15, False), 2: (-9, True)}, name=_name)
    assert "target rank 0 (did not stop by itself: stopped by SIGTERM)" in line
    assert "most likely trainer rank 2:" in line


def test_ordinary_failures_keep_their_cause():
    # a crash (exit status 1): the others' lost peer is their reaction; a stuck rank is a victim
    line, status = supervisor.failure_summary(
        {0: 1, 1: 3}, {0: 10.0, 1: 10.5}, {2: (-9, True)}, name=_name)
    assert line == ("failed: target rank 0 (exit status 1), trainer rank 1 (exit status 3); "
                    "the first cause is most likely target rank 0")
    assert status == 1
    # a rank killed by a signal at the same moment goes first
    line, status = supervisor.failure_summary({1: 3, 0: -9}, {1: 10.0, 0: 10.1}, {}, name=_name)
    assert line.endswith("the first cause is most likely target rank 0") and status == 128 + 9
    # a lone failure, no rank left to stop: nothing more to say
    assert supervisor.failure_summary({1: 3}, {1: 10.0}, {}, name=_name) == (None, 3)


HUNG_RANK = """\
import os, signal, sys, time
rank = int(os.environ["RANK"])
out = sys.argv[1]
open(os.path.join(out, f"rank{rank}.ready"), "w").close()
if rank == 0:  # hung: stopped, so that SIGTERM cannot reach it
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(600)
while not os.path.exists(os.path.join(out, "rank0.ready")):
    time.sleep(0.05)
time.sleep(0.5 * rank)  # the trainers notice the silence, one after the other
os._exit(3)  # the lost-peer status
"""


@pytest.mark.distributed
def test_a_hung_rank_is_named_by_the_launcher(tmp_path):
    """A real launcher: rank 0 stops itself (SIGSTOP), ranks 1 and 2 exit with the lost-peer
    status; the launcher kills rank 0 after the grace and names it."""
    script = tmp_path / "rank.py"
    script.write_text(HUNG_RANK)
    code = (
        "import sys; from draftforge.splitserve.supervisor import run_ranks; "
        f"sys.exit(run_ranks([sys.executable, {str(script)!r}, {str(tmp_path)!r}], nproc=3, "
        "labels={0: 'target rank 0', 1: 'trainer rank 1', 2: 'trainer rank 2'}, "
        "grace_s=3.0, term_s=1.0))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "target rank 0 did not stop within 1 s of SIGTERM" in proc.stderr, proc.stderr
    assert ("failed: trainer rank 1 (exit status 3), trainer rank 2 (exit status 3), target rank 0 "
            "(did not stop by itself: killed by SIGKILL after SIGTERM); the first cause is most "
            "likely target rank 0") in proc.stderr, proc.stderr


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
