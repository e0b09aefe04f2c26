"""``FeatureRunnerProcess``: one child per tensor-parallel rank, run in lockstep, failures surfaced.

The children here run ``tp_runner_helpers.GlooShardedRunner`` instead of SGLang's
``ModelRunner``: each holds a shard of the hidden dimension and all-reduces over gloo, so the
states that come back equal one process's whole product only if every rank got the same rows,
its own ``tp_rank`` and the port the parent chose.
"""

from __future__ import annotations

import time

import pytest
import torch
from tp_runner_helpers import GlooShardedRunner, reference

from draftforge.splitserve.sglang_runner import FeatureRunnerProcess, free_port

ROWS = [torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9, 2]), torch.tensor([6, 5, 3, 5, 8, 9, 7])]


def start(tp_size: int, **extra) -> FeatureRunnerProcess:
    return FeatureRunnerProcess({"tp_size": tp_size, **extra}, runner_cls=GlooShardedRunner)


@pytest.mark.parametrize("tp_size", [1, 2, 3])
def test_states_are_the_whole_product_from_every_rank_in_lockstep(tp_size):
    runner = start(tp_size)
    try:
        assert runner.max_total_tokens == 1000  # the smallest of the ranks' pools
        for rows in (ROWS, ROWS[1:2]):  # twice: the ranks stay in step across calls
            aux, final = runner.features(rows)
            want_aux, want_final = reference(rows)
            assert aux.shape == (sum(len(r) for r in rows), want_aux.shape[1])
            torch.testing.assert_close(aux, want_aux, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(final, want_final, rtol=1e-5, atol=1e-5)
        processes = list(runner._processes)
        assert len(processes) == tp_size
    finally:
        runner.close()
    assert not any(process.is_alive() for process in processes)


def test_a_rank_that_fails_stops_the_group_with_its_traceback():
    """Rank 1 raises while rank 0 waits for it in an all-reduce: the error names rank 1 and
    carries its traceback, and rank 0 is stopped rather than left waiting."""
    runner = start(2, fail=["features", 1])
    processes = list(runner._processes)
    begin = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        runner.features(ROWS)
    assert time.monotonic() - begin < 60
    message = str(caught.value)
    assert "feature runner (tensor-parallel rank 1 of 2) failed while computing features" in message
    assert "ValueError: boom on tensor-parallel rank 1" in message
    assert not any(process.is_alive() for process in processes)
    with pytest.raises(RuntimeError, match="was stopped"):
        runner.features(ROWS)


def test_a_rank_that_exits_while_starting_is_reported():
    """Rank 1 exits before joining; rank 0 would wait for it in the rendezvous."""
    with pytest.raises(RuntimeError, match=r"rank 1 of 2\) exited \(exit code 5\) while starting"):
        start(2, fail=["start-exit", 1])


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    import socket

    port = free_port()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
        ephemeral_low = int(handle.read().split()[0])
    assert 22000 <= port < ephemeral_low
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
