"""The trainer -> target channel (the ack group) as a target rank hears it.

Each test runs one target rank (0) and two trainer ranks (1, 2) over gloo on CPU: a
whole SplitServe job, or this module's workers in their own processes, the target's
:class:`~draftforge.splitserve.transport.AckListener` (started with the rank, as
``roles`` starts it) and :class:`~draftforge.splitserve.transport.CreditGate` against
the trainers' :class:`~draftforge.splitserve.transport.AckLink`.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from splitserve_helpers import (
    PYTHON,
    ROOT,
    free_port,
    rank_env,
    read_logs,
    run_on_ranks,
    spawn_ranks,
    tiny_recipe,
    wait_all,
)

pytestmark = pytest.mark.distributed

GROUP_TIMEOUT_S = 60  # the ack group's timeout: a dead trainer must be named well before it


def _init():
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    ack = dist.new_group([0, 1, 2], backend="gloo",
                         timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    return dist.get_rank(), ack


def _write(out: str, rank: int, result: dict) -> None:
    Path(out).with_suffix(f".{rank}.json").write_text(json.dumps(result))


def early_stop_worker(out: str) -> None:
    """Trainer 1 already has its steps: it sends its resume state and its stop at once;
    trainer 2 sends its resume state after that (released by trainer 1), then one credit
    and its stop. The target builds its gate only once both resume states are in."""
    import torch
    import torch.distributed as dist

    from draftforge.splitserve import transport as T

    rank, ack = _init()
    result: dict = {}
    if rank == 0:
        listener = T.AckListener([1, 2], group=ack)
        result["ids"] = sorted(listener.result())
        gate = T.CreditGate([1, 2], 2, timeout_s=6, listener=listener)
        try:
            result["all_stopped"] = gate.wait_all_stopped(8)
        except T.PeerDied as exc:
            result["all_stopped"] = str(exc)
        result["stopped"] = sorted(gate.stopped)
        result["consumed"] = {str(k): v for k, v in gate.consumed.items()}
    else:
        link = T.AckLink([0], group=ack, every_s=0.5)
        flag = torch.zeros(1)
        if rank == 1:
            link.hello({"a": 5})
            link.stop()
            dist.send(flag, dst=2)  # after the stop: trainer 2 may say hello
        else:
            dist.recv(flag, src=1)
            time.sleep(1.0)
            link.hello({"b": 0})
            time.sleep(1.0)
            link.ack(0, 2)
            link.stop()
    _write(out, rank, result)
    dist.barrier()
    os._exit(0)


def dead_trainer_worker(out: str, when: str) -> None:
    """Trainer 2 crashes (before its resume state when ``when`` is "hello", after it when
    "credits") while trainer 1 lives and beats; the target must name trainer 2 at once."""
    from draftforge.splitserve import transport as T

    rank, ack = _init()
    result: dict = {}
    if rank == 0:
        begin = time.monotonic()
        listener = T.AckListener([1, 2], group=ack)
        try:
            listener.result()
            gate = T.CreditGate([1, 2], 2, timeout_s=GROUP_TIMEOUT_S, listener=listener)
            result["outcome"] = gate.wait_all_stopped(GROUP_TIMEOUT_S)
        except T.PeerDied as exc:
            result["outcome"] = str(exc)
            result["rank"] = exc.rank
        result["after_s"] = time.monotonic() - begin
        _write(out, rank, result)
        os._exit(0)
    link = T.AckLink([0], group=ack, every_s=0.5)
    if rank == 2:
        if when == "credits":
            link.hello({})
        time.sleep(1.0)
        os._exit(9)  # the trainer crashes
    link.hello({})
    deadline = time.monotonic() + 2 * GROUP_TIMEOUT_S
    while link.error is None and time.monotonic() < deadline:  # beat until the target is gone
        time.sleep(0.2)
    os._exit(0)


def _run(worker: str, out: Path, timeout: float) -> tuple[list[int], list[str]]:
    """Run ``worker`` (a call on ``out``) on ranks 0-2; their exit codes and output."""
    return run_on_ranks(f"import test_ack_channel as t; t.{worker.format(out=repr(str(out)))}", 3, timeout)


def test_a_stop_sent_before_the_gate_starts_is_kept(tmp_path):
    """A trainer that stops right after its resume state (a rerun of a finished job) is
    stopped for the gate, which starts after the other trainer's resume state: the stop
    was not taken for a heartbeat and dropped (the target kept feeding that trainer, got
    no credits back and reported it dead after split.peer_timeout_s)."""
    out = tmp_path / "early"
    codes, logs = _run("early_stop_worker({out})", out, timeout=120)
    assert codes == [0, 0, 0], logs
    target = json.loads(out.with_suffix(".0.json").read_text())
    assert target == {"ids": ["a", "b"], "all_stopped": True, "stopped": [1, 2],
                      "consumed": {"1": 0, "2": 2}}, logs[0]


@pytest.mark.parametrize("when", ["hello", "credits"])
def test_a_crashed_trainer_is_named_at_once(tmp_path, when):
    """A trainer process that dies closes its connections: the target reports that trainer
    rank as dead within seconds, while its other trainer keeps beating, not as silent after
    the group's timeout (a receive from any source waited it out, or, with another trainer
    beating, for ever)."""
    out = tmp_path / when
    codes, logs = _run(f"dead_trainer_worker({{out}}, {when!r})", out, timeout=2 * GROUP_TIMEOUT_S)
    assert codes == [0, 0, 9], logs
    target = json.loads(out.with_suffix(".0.json").read_text())
    assert target["rank"] == 2, target
    assert target["outcome"].startswith("trainer rank 2 died or closed its connection"), target
    doing = {"hello": "waiting for the resume state of", "credits": "waiting for credits from"}
    assert target["outcome"].endswith(f"(while {doing[when]} trainer rank 2)"), target
    assert target["after_s"] < GROUP_TIMEOUT_S / 3, target


# the trainer's resume state goes DELAY seconds late (a trainer slower to resume than the other)
SLOW_HELLO = """\
import sys
import time
from draftforge.splitserve import transport as T
_hello = T.AckLink.hello
def _slow_hello(self, ids):
    time.sleep({delay})
    return _hello(self, ids)
T.AckLink.hello = _slow_hello
from draftforge.train.__main__ import exit_now, main
exit_now(main([sys.argv[1]]))
"""


def test_a_finished_job_rerun_ends_at_once(tmp_path):
    """A finished 2-trainer job run again: each trainer, at train.steps already, says stop
    right after its resume state; trainer 1's comes late. Every rank ends with status 0
    well within split.peer_timeout_s (the target kept feeding trainer 2, whose stop it had
    lost, and reported it silent after the timeout)."""
    timeout_s = 60
    recipe = tiny_recipe(tmp_path, trainers=2, steps=4, num_conversations=64,
                         overrides={"split.peer_timeout_s": timeout_s})
    codes = wait_all(spawn_ranks(recipe, 3, log_dir=tmp_path / "first"), 300)
    assert codes == [0, 0, 0], read_logs(tmp_path / "first", 3)
    port, log_dir = free_port(), tmp_path / "rerun"
    log_dir.mkdir()
    procs = []
    for rank in range(3):
        code = SLOW_HELLO.format(delay=4) if rank == 1 else (
            "import sys\nfrom draftforge.train.__main__ import exit_now, main\n"
            "exit_now(main([sys.argv[1]]))\n")
        procs.append(subprocess.Popen(
            [PYTHON, "-c", code, str(recipe)], env=rank_env(rank, 3, port), cwd=ROOT,
            stdout=open(log_dir / f"rank{rank}.log", "w"), stderr=subprocess.STDOUT))
    begin = time.monotonic()
    codes = wait_all(procs, 300)
    logs = read_logs(log_dir, 3)
    assert codes == [0, 0, 0], "\n\n".join(log[-2000:] for log in logs)
    assert "finished at step 4" in logs[1], logs[1]
    # the ranks' start and the late resume state aside, no wait
    assert time.monotonic() - begin < timeout_s, "\n\n".join(logs)
