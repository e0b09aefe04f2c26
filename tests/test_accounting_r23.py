"""Review round 23 of splitserve/accounting.py and splitserve/bench_split.py."""

from __future__ import annotations

import pytest


def test_recommend_split_refuses_a_world_with_no_room_for_a_trainer():
    """A tensor-parallel target group of 2 in a world of 2 leaves no trainer rank: no split,
    not "2 target + 0 trainer" at 0 tok/s."""
    from draftforge.splitserve.accounting import recommend_split

    with pytest.raises(ValueError, match="no trainer rank"):
        recommend_split(2, 100.0, 100.0, tensor_parallel=2)
    with pytest.raises(ValueError, match="no trainer rank"):
        recommend_split(4, 100.0, 100.0, tensor_parallel=4)
    # one group and one trainer is the smallest split there is
    assert recommend_split(3, 100.0, 50.0, tensor_parallel=2) == (2, 1, 50.0)


def test_the_queue_depth_is_documented_as_consumer_stream_counts_it():
    """ConsumerStream passes the queue's depth at the take with the taken sample in it (at
    least 1), and the mean is over takes: neither docstring says "left behind", and the
    module says the mean is per take, not time-weighted."""
    from draftforge.splitserve import accounting

    assert "left behind" not in accounting.ConsumerAccounting.on_take.__doc__
    assert "this\n        one included" in accounting.ConsumerAccounting.on_take.__doc__
    assert "its mean is over the takes, not\n  weighted by time" in accounting.__doc__


def test_the_queue_mean_is_over_takes(monkeypatch):
    """Depths 4, 1, 1 at three takes: mean 2.0 whatever the time between them, max 4."""
    import types

    from draftforge.splitserve import accounting
    from draftforge.splitserve.accounting import ConsumerAccounting

    clock = [0.0]
    monkeypatch.setattr(accounting, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    acc = ConsumerAccounting(world=2, num_target=1, credits=4)
    # depth 4 then held for 100 s, each 1 for a second and 99 s: weighted by time the mean
    # would be (4 * 100 + 1 * 1 + 1 * 99) / 200 = 2.5, over the takes it is (4 + 1 + 1) / 3
    for depth, then in ((4, 100.0), (1, 1.0), (1, 99.0)):
        acc.on_take(depth=depth, tokens=10, waited_s=0.0)
        clock[0] += then
    queue = acc.snapshot()["queue"]
    assert queue == {"mean": 2.0, "max": 4, "credits": 4}


def test_bench_split_says_both_idle_shares_cover_the_steady_window():
    """The machine-readable target_idle is the steady window's when there is one (from the
    producers' reports at its two ends), as the trainer's is; the target also idles for its
    turn at a trainer, not only for credits."""
    from draftforge.splitserve import bench_split

    doc = " ".join(bench_split.__doc__.split())
    assert ("target: waiting for credits or for its turn at a trainer, from its reports on the "
            "wire), each over the steady window when there is one") in doc
