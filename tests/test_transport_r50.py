"""Session 50: on a GPU each metered part of a send waits for its stream."""

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
