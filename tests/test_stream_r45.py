"""Round 45: the trainer's queue-depth accounting keeps bounded state (running counts per depth
and a thinned series, not one entry per sample taken), and a receive or heartbeat thread whose
device cannot be set reports that instead of dying silently."""

import random
import time
import tracemalloc

import pytest

from draftforge.splitserve import transport as T
from draftforge.splitserve.accounting import ConsumerAccounting


def _window(depths):
    return (sum(depths) / len(depths) if depths else 0.0), (max(depths) if depths else 0)


def test_queue_mean_and_max_of_every_window_match_a_slow_count():
    """Whole run, each log interval and the steady state after the first step, against the
    depths listed one by one."""
    rng = random.Random(45)
    acc = ConsumerAccounting(world=2, num_target=1, credits=6)
    every, since_line, since_first = [], [], None
    for step in range(40):
        for _ in range(rng.randint(0, 7)):
            depth = rng.choice([1, 1, 2, 3, 6, 9])  # 9: above the credits, as several producers give
            acc.on_take(depth, 10, 0.0)
            every.append(depth)
            since_line.append(depth)
            if since_first is not None:
                since_first.append(depth)
        acc.on_step({"compute_s": 0.1, "wait_s": 0.0})
        if step == 0:
            since_first = []
        if step % 5 == 4:
            acc.line()
            mean, top = _window(since_line)
            window = acc._last_window["queue"]
            assert window["mean"] == pytest.approx(mean) and window["max"] == top
            since_line = []
    whole = acc.snapshot()["queue"]
    assert (whole["mean"], whole["max"]) == (pytest.approx(_window(every)[0]), _window(every)[1])
    steady = acc.snapshot(since=acc._first_step)["queue"]
    mean, top = _window(since_first)
    assert steady["mean"] == pytest.approx(mean) and steady["max"] == top
    assert acc.takes == len(every)


def test_an_interval_with_no_take_has_an_empty_queue_window():
    acc = ConsumerAccounting(world=2, num_target=1, credits=4)
    acc.on_take(3, 10, 0.0)
    acc.line()
    acc.on_step({"compute_s": 0.1, "wait_s": 0.0})
    acc.line()
    assert acc._last_window["queue"]["mean"] == 0.0 and acc._last_window["queue"]["max"] == 0


def test_the_depth_record_does_not_grow_with_the_run():
    """A long run (millions of samples a trainer at scale) held one (time, depth) pair per
    sample taken; 200,000 takes now add next to nothing to the trainer's memory."""
    acc = ConsumerAccounting(world=2, num_target=1, credits=4)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for k in range(200_000):
            acc.on_take(1 + k % 4, 10, 0.0)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 200_000, f"{grown} bytes kept for 200,000 takes"
    assert acc.snapshot()["queue"]["mean"] == pytest.approx(2.5)


def test_the_depth_series_spans_the_run_in_order_thinned_to_the_points_asked():
    acc = ConsumerAccounting(world=2, num_target=1, credits=4)
    depths = [1 + (k * 7) % 5 for k in range(10_001)]
    for depth in depths:
        acc.on_take(depth, 10, 0.0)
    series = acc.depth_series(points=200)
    assert 100 <= len(series) <= 200
    times = [t for t, _ in series]
    assert times == sorted(times)
    stride = acc._stride * max(1, -(-len(acc._series) // 200))
    assert [d for _, d in series] == depths[::stride][: len(series)]  # every stride-th take, from the first
    few = ConsumerAccounting(world=2, num_target=1, credits=4)
    for depth in (2, 1, 3):
        few.on_take(depth, 10, 0.0)
    assert [d for _, d in few.depth_series()] == [2, 1, 3]


def _wait(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def _unusable_device(monkeypatch):
    """A GPU the thread cannot make current, as ``torch.cuda.set_device`` refuses a device
    ordinal the machine lacks."""
    def refuse(device):
        raise RuntimeError(f"CUDA error: invalid device ordinal ({device})")

    monkeypatch.setattr(T.torch.cuda, "set_device", refuse)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_receiver_whose_device_cannot_be_set_raises_in_get_instead_of_waiting_forever(monkeypatch):
    """The receive thread set its device before its try: the error ended the thread unseen and
    get() polled an empty queue forever."""
    _unusable_device(monkeypatch)
    receiver = T.SampleReceiver([1], credits=2, device="cuda:7")
    receiver.join(timeout=20)
    with pytest.raises(RuntimeError, match="invalid device ordinal") as raised:
        receiver.get(poll_s=0.05, max_wait_s=3.0)  # the old thread: IDLE after 3 s, never an error
    assert raised.value is receiver.error


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_pulse_whose_device_cannot_be_set_hands_the_error_to_its_producer(monkeypatch):
    """The producer's heartbeat thread died unseen the same way: no beats, and nothing told the
    producer, whose trainers then reported it dead after split.peer_timeout_s."""
    _unusable_device(monkeypatch)
    pulse = T.Pulse(every_s=0.05, device="cuda:7")
    try:
        assert _wait(lambda: not pulse._thread.is_alive())
        errors = []
        pulse.expect([1], on_error=errors.append)
        assert isinstance(pulse.error, RuntimeError) and errors == [pulse.error]
    finally:
        pulse.close()
