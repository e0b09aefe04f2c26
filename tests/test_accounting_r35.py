"""Review round 35 of splitserve/accounting.py: the gaps the earlier rounds left untested,
each checked against values derived by hand (fake clocks, recorded readings, no timing)."""

from __future__ import annotations

import json
import types

import pytest


def _fake_clock(monkeypatch, start: float = 0.0) -> list[float]:
    from draftforge.splitserve import accounting as A

    clock = [start]
    monkeypatch.setattr(A, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    return clock


def test_the_meters_parts_and_wire_stats_follow_its_clock(monkeypatch):
    """Start at t=10; generate 2 s, wait for a credit 1 s, send 0.5 s, then 0.5 s in neither
    (bookkeeping): at t=14 the wire carries busy 2.5 s, idle 1 s, wall 4 s (in microseconds),
    and busy + idle falls short of the wall by the untimed 0.5 s."""
    from draftforge.splitserve.accounting import Meter

    clock = _fake_clock(monkeypatch, 10.0)
    meter = Meter()
    assert meter.wall_s == 0.0  # not started
    meter.start()
    for kind, part, seconds in (("busy", "generate", 2.0), ("idle", "credits", 1.0), ("busy", "send", 0.5)):
        with getattr(meter, kind)(part):
            clock[0] += seconds
    clock[0] += 0.5
    meter.add_tokens(300)
    assert meter.wire_stats() == [2_500_000, 1_000_000, 300, 4_000_000]
    meter.stop()
    clock[0] += 100.0  # after the stop the wall stands
    s = meter.summary()
    assert (s["busy_s"], s["idle_s"], s["wall_s"]) == (2.5, 1.0, 4.0)
    assert (s["busy_share"], s["idle_share"]) == (0.625, 0.25)
    assert (s["rate_tok_s"], s["capacity_tok_s"]) == (75.0, 120.0)
    assert s["busy_by_part_s"] == {"generate": 2.0, "send": 0.5}


def test_each_interval_window_holds_that_interval_alone(monkeypatch, tmp_path):
    """Two intervals of two steps. Interval 1 (t=0..10): steps of 1 s wait + 4 s compute,
    100 + 100 tokens; the producer reports busy 4 / idle 1 / wall 6 / 400 tokens. Interval 2
    (t=10..16): steps of 2 s wait + 1 s compute, 50 + 50 tokens; the producer reports busy
    7 / idle 4 / wall 12 / 700 tokens. The second window is the differences alone (trainer
    busy 2 of 6 s, 100 tokens; producer busy 3 of 6 s, 300 tokens), the record's own
    figures the whole run (busy 10 of 16 s, 300 tokens)."""
    from draftforge.splitserve.accounting import ConsumerAccounting

    clock = _fake_clock(monkeypatch)
    path = tmp_path / "accounting.jsonl"
    acc = ConsumerAccounting(world=2, num_target=1, credits=4, path=path)
    acc.begin(0)
    plan = [((1.0, 4.0, 100, 2), None), ((1.0, 4.0, 100, 1), (4.0, 1.0, 6.0, 400.0)),
            ((2.0, 1.0, 50, 3), None), ((2.0, 1.0, 50, 1), (7.0, 4.0, 12.0, 700.0))]
    lines = []
    for step, ((wait, compute, tokens, depth), report) in enumerate(plan, start=1):
        clock[0] += wait
        acc.on_take(depth=depth, tokens=tokens, waited_s=wait, sample_id=f"s{step}")
        if report is not None:
            busy, idle, wall, produced = report
            acc.on_producer_stats(0, {"busy_s": busy, "idle_s": idle, "wall_s": wall, "tokens": produced})
        clock[0] += compute
        acc.on_step({"compute_s": compute, "wait_s": wait, "sample_ids": [f"s{step}"]})
        if step % 2 == 0:
            lines.append(acc.line())
            acc.write("interval", step)
    assert lines[1] == ("split (last interval): target busy 50% idle 50% 50 tok/s (capacity 100) | "
                        "trainer busy 33% idle 67% 17 tok/s (capacity 50) | queue 2.0 avg 3 max of 4")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["event"] for r in records] == ["start", "interval", "interval"]
    first, second = records[1]["window"], records[2]["window"]
    assert (first["consumer"]["busy_s"], first["consumer"]["wall_s"], first["consumer"]["tokens"]) == (8.0, 10.0, 200)
    assert (first["queue"]["mean"], first["queue"]["max"]) == (1.5, 2)
    c, p = second["consumer"], second["producer"]
    assert (c["busy_s"], c["idle_s"], c["wall_s"], c["tokens"]) == (2.0, 4.0, 6.0, 100)
    assert (p["busy_s"], p["idle_s"], p["wall_s"], p["tokens"]) == (3.0, 3.0, 6.0, 300)
    assert second["samples"] == 2 and second["time_s"] == 16.0
    whole = records[2]["consumer"]
    assert (whole["busy_s"], whole["idle_s"], whole["wall_s"], whole["tokens"]) == (10.0, 6.0, 16.0, 300)
    assert records[2]["queue"]["mean"] == pytest.approx(7 / 4)


def test_a_resumed_run_appends_a_fresh_segment_after_a_torn_line(monkeypatch, tmp_path):
    """The interrupted run left an interval record and half of the next: the resumed run cuts
    the half line, opens its segment with a start record at the checkpoint's step, and its
    figures start from zero (its own time, not the interrupted run's)."""
    from draftforge.splitserve.accounting import ConsumerAccounting

    clock = _fake_clock(monkeypatch, 500.0)
    path = tmp_path / "accounting.jsonl"
    earlier = json.dumps({"event": "interval", "step": 10, "time_s": 40.0})
    path.write_text(earlier + "\n" + '{"event": "interval", "step": 20, "ti')
    acc = ConsumerAccounting(world=2, num_target=1, credits=4, path=path)
    acc.begin(10)
    clock[0] += 3.0
    acc.on_take(depth=1, tokens=60, waited_s=1.0, sample_id="a")
    acc.on_producer_stats(0, {"busy_s": 2.0, "idle_s": 0.0, "wall_s": 2.5, "tokens": 60.0})
    acc.on_step({"compute_s": 2.0, "wait_s": 1.0, "sample_ids": ["a"]})
    acc.write("summary", 11)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["event"], r["step"]) for r in records] == [("interval", 10), ("start", 10), ("summary", 11)]
    assert records[1]["time_s"] == 0.0 and records[1]["consumer"]["tokens"] == 0
    c = records[2]["consumer"]
    assert (c["busy_s"], c["idle_s"], c["wall_s"], c["tokens"], c["rate_tok_s"]) == (2.0, 1.0, 3.0, 60, 20.0)
    assert records[2]["queue_depth_over_time"] == [[3.0, 1]]


@pytest.mark.parametrize(("world", "producer", "consumer", "tp", "expected"), [
    # 100 / 300 a rank, 4 ranks: T=1 100, T=2 200, T=3 min(300, 300) = 300
    (4, 100.0, 300.0, 1, (3, 1, 300.0)),
    # 7 ranks at 100 / 100: T=2 feeds 5 trainers 5 x 100 / 3 = 166.7 (one target feeds 3),
    # T=3 feeds 4 at 4 x 100 / 2 = 200, T=4 feeds 3 at 3 x 100 = 300 against 300, T=5 2 x 2 x 100 = 400
    # against 200: 4 + 3 at 300
    (7, 100.0, 100.0, 1, (4, 3, 300.0)),
    # more producers than trainers, uneven: 5 ranks at 100 / 250: T=3 feeds 2 trainers at
    # 2 x floor(3 / 2) x 100 = 200 (not 300) against 500; T=2 3 x 100 / 2 = 150 against 750;
    # T=4 400 against 250
    (5, 100.0, 250.0, 1, (4, 1, 250.0)),
    # tensor-parallel pairs of 300 tok/s a pair, 10 ranks, trainers 100: T=2 min(300, 800),
    # T=4 (2 pairs, 6 trainers) min(6 x 300 / 3, 600) = 600, T=6 (3 pairs feed 4 trainers, one
    # pair two of them) min(4 x 300 / 2, 400) = 400, T=8 (4 pairs, 2 trainers) min(1200, 200):
    # 4 + 6 at 600
    (10, 300.0, 100.0, 2, (4, 6, 600.0)),
])
def test_recommended_splits_worked_by_hand(world, producer, consumer, tp, expected):
    from draftforge.splitserve.accounting import recommend_split

    num_t, num_r, rate = recommend_split(world, producer, consumer, tensor_parallel=tp)
    assert (num_t, num_r) == expected[:2] and rate == pytest.approx(expected[2])
