"""Session 50: the split accounting on a GPU (each metered part waits for its stream), intervals
without a producer report, and a trainer's time between steps."""

from __future__ import annotations

import contextlib

import torch

from draftforge.splitserve import transport


class _Meter:
    def __init__(self, events):
        self.events = events

    @contextlib.contextmanager
    def busy(self, what):
        self.events.append(f"busy {what} <")
        yield
        self.events.append(f"busy {what} >")

    @contextlib.contextmanager
    def idle(self, what):
        self.events.append(f"idle {what} <")
        yield
        self.events.append(f"idle {what} >")


def test_each_metered_part_of_a_send_waits_for_the_device_before_it_closes(monkeypatch):
    """NCCL's send and a copy to the GPU return before the work is done: the wait for the
    trainer to take the header was booked as busy (in the next copy), and the features' transfer
    fell outside every block. Each block now ends with settle(device), which on a GPU waits for
    the stream (on the CPU it returns at once, as gloo's send is done when it returns)."""
    events: list[str] = []
    monkeypatch.setattr(transport, "_send", lambda tensor, dst, *a: events.append(f"send {tensor.dtype}"))
    monkeypatch.setattr(transport, "settle", lambda device: events.append(f"settle {device}"))
    transport.send_sample(1, "s0", torch.tensor([1, 2]), torch.tensor([0, 1]), torch.zeros(2, 6),
                          torch.zeros(2, 3), seq_no=0, device="cpu", meter=_Meter(events))
    assert events == [
        "busy send <", "settle cpu", "busy send >",
        "idle turn <", "send torch.int64", "settle cpu", "idle turn >",
        "busy send <", "send torch.int64", "send torch.bfloat16", "settle cpu", "busy send >",
    ]


def test_settle_waits_for_a_gpu_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    transport.settle("cpu")
    transport.settle(torch.device("cpu"))
    assert calls == []
    transport.settle("cuda:1")
    assert calls == [torch.device("cuda:1")]


def first_interval(monkeypatch):
    """A trainer's accounting on a clock the test sets (``clock[0]``), after a first 10 s
    interval: the target 8 s busy of 10 for 500 tokens, one sample taken, a step of 5 s
    computing and 5 s waiting (its line not yet asked for)."""
    import types

    from draftforge.splitserve import accounting

    clock = [0.0]
    monkeypatch.setattr(accounting, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    acc = accounting.ConsumerAccounting(world=2, num_target=1, credits=4)
    acc.on_producer_stats(0, {"busy_s": 8.0, "idle_s": 2.0, "tokens": 500, "wall_s": 10.0})
    acc.on_take(depth=1, tokens=500, waited_s=0.0)
    clock[0] = 10.0
    acc.on_step({"sample_ids": [], "compute_s": 5.0, "wait_s": 5.0})
    return acc, clock


def test_an_interval_without_a_producer_report_says_so_instead_of_zeros(monkeypatch):
    """A long generation chunk can leave a log interval with no sample header: the line read
    'target busy 0% idle 0% 0 tok/s (capacity 0)' while the target was busy the whole time."""
    acc, clock = first_interval(monkeypatch)
    first = acc.line()
    assert "target busy 80% idle 20% 50 tok/s (capacity 62)" in first
    clock[0] = 20.0
    acc.on_step({"sample_ids": [], "compute_s": 5.0, "wait_s": 5.0})  # no header since
    assert "split (last interval): target: no report this interval (no sample arrived) | trainer busy" in acc.line()


def test_a_trainers_time_between_steps_is_shown_as_other_not_left_out(monkeypatch):
    """A checkpoint save between two steps is neither compute nor wait: the interval read
    'trainer busy 40% idle 20%' with the rest unexplained."""
    import types

    from draftforge.splitserve import accounting

    clock = [0.0]
    monkeypatch.setattr(accounting, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    acc = accounting.ConsumerAccounting(world=2, num_target=1, credits=4)
    acc.on_producer_stats(0, {"busy_s": 8.0, "idle_s": 2.0, "tokens": 500, "wall_s": 10.0})
    clock[0] = 10.0
    acc.on_step({"sample_ids": [], "compute_s": 4.0, "wait_s": 2.0})  # 4 s went to a save
    assert "trainer busy 40% idle 20% other 40% (checkpoints, logging) " in acc.line()
    assert "trainer (this rank): busy 40.0%  idle 20.0% other 40.0% (checkpoints, logging)" in acc.summary_text()
    clock[0] = 20.0
    acc.on_step({"sample_ids": [], "compute_s": 7.0, "wait_s": 3.0})
    assert "trainer busy 70% idle 30% 0 tok/s" in acc.line()  # nothing else: no 'other'
