"""SplitServe stream, round 9: the dropped ids that ride on a SAMPLE message come off the
wire as they were sent, beside the sample's own id, tokens and features."""

from __future__ import annotations

import types
from collections import deque

import torch

from draftforge.splitserve import transport as T


def _loopback(monkeypatch) -> deque:
    """Point-to-point sends into a FIFO that the receives read from (one process); the FIFO
    is returned so a test can read the raw messages."""
    wire: deque[torch.Tensor] = deque()

    def send(tensor, dst, group=None):
        wire.append(tensor.clone())

    def recv(tensor, src=None, group=None):
        sent = wire.popleft()
        assert sent.dtype == tensor.dtype and sent.shape == tensor.shape, (sent.shape, tensor.shape)
        tensor.copy_(sent)
        return src

    monkeypatch.setattr(T, "dist", types.SimpleNamespace(send=send, recv=recv))
    return wire


def test_the_dropped_ids_of_a_sample_come_off_the_wire_as_sent(monkeypatch):
    """Several ids of different UTF-8 lengths (one of a later epoch), then a sample with none:
    each message's ids are its own, and the sample id, tokens and mask around them intact."""
    _loopback(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    sent = [
        ("conv-7-é", 5, ("conv-1", "ünï-✓", "conv-0002#e3")),
        ("conv-8", 3, ()),
        ("x", 1, ("y",)),
    ]
    for n, (sample_id, length, dropped) in enumerate(sent):
        T.send_sample(1, sample_id, torch.randint(0, 49152, (length,), generator=gen),
                      torch.rand(length, generator=gen) > 0.5, torch.randn(length, 6, generator=gen),
                      torch.randn(length, 2, generator=gen), seq_no=n, dropped_ids=dropped)
    T.send_end(1)
    gen = torch.Generator().manual_seed(0)  # the same draws, for the expected values
    for n, (sample_id, length, dropped) in enumerate(sent):
        ids = torch.randint(0, 49152, (length,), generator=gen)
        mask = torch.rand(length, generator=gen) > 0.5
        aux, final = torch.randn(length, 6, generator=gen), torch.randn(length, 2, generator=gen)
        wire = T.recv_sample(0)
        assert (wire.sample_id, wire.dropped_ids, wire.seq_no) == (sample_id, dropped, n)
        assert torch.equal(wire.input_ids, ids) and torch.equal(wire.loss_mask, mask)
        assert torch.equal(wire.aux, aux.to(torch.bfloat16))
        assert torch.equal(wire.final, final.to(torch.bfloat16))
    assert T.recv_sample(0) is None
