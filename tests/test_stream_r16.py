"""Review round 16 of SplitServe streaming: the wire's id bytes, the end of a trainer's stream."""

from __future__ import annotations

import time
import types
from collections import deque

import pytest
import torch
from test_stream_r14 import CLOSED, _loopback

from draftforge.splitserve import transport as T


def _put_sample(wire: deque, tail: list[int], *, id_len: int, num_dropped: int = 0, seq_no: int = 7) -> None:
    """A SAMPLE of 3 positions whose ints end in ``tail`` (the id bytes, then the dropped ids'
    lengths and bytes), as a producer would put it on the wire."""
    seq, dropped_len = 3, len(tail) - id_len - num_dropped
    wire.append(T._header(T.SAMPLE, [seq, 2, 2, T.DTYPE_CODES[T.WIRE_DTYPE], id_len, seq_no,
                                     0, 0, 0, 0, 0, num_dropped, dropped_len]))
    wire.append(torch.tensor([5, 6, 7, 1, 1, 0, *tail], dtype=torch.int64))
    wire.append(torch.zeros(seq, 4, dtype=T.WIRE_DTYPE))


# --------------------------------------------------------------------------- the wire's id bytes


@pytest.mark.parametrize("tail, id_len, num_dropped, problem", [
    ([ord("a"), 300], 2, 0, "whose id bytes are not all in 0-255 (e.g. 300)"),
    ([ord("a"), -1], 2, 0, "whose id bytes are not all in 0-255 (e.g. -1)"),
    ([0xFF, 0xFE], 2, 0, "whose ids are not UTF-8"),
    ([ord("a"), 1, 0xC3], 1, 1, "whose ids are not UTF-8"),  # a dropped id cut inside a character
    ([ord("a"), 5, ord("b")], 1, 1, "whose id lengths [5] do not add up to its 1 id bytes"),
    ([ord("a"), -1, 1, ord("b")], 1, 2, "whose id lengths [-1, 1] do not add up to its 1 id bytes"),
])
def test_malformed_id_bytes_in_a_sample_are_a_wire_error_naming_the_sender(monkeypatch, tail, id_len,
                                                                          num_dropped, problem):
    """A sample whose id bytes were not bytes raised a bare ValueError ("bytes must be in
    range(0, 256)"), ones that were not UTF-8 a UnicodeDecodeError, and dropped-id lengths
    that did not add up to their bytes cut the ids silently: none said that rank 3 sent
    something this version cannot read (the receive thread hands a WireError on as such)."""
    wire, _ = _loopback(monkeypatch)
    _put_sample(wire, tail, id_len=id_len, num_dropped=num_dropped)
    with pytest.raises(T.WireError) as caught:
        T.recv_sample(3)
    text = str(caught.value)
    assert text.startswith("rank 3 sent the sample with seq_no 7 ") and problem in text, text
    # a well-formed one still comes through, with its dropped ids
    dropped = ["conv-1", "é✓"]
    encoded = [d.encode() for d in dropped]
    _put_sample(wire, [*"s-ü".encode(), *(len(b) for b in encoded), *b"".join(encoded)],
                id_len=len("s-ü".encode()), num_dropped=2)
    got = T.recv_sample(3)
    assert got.sample_id == "s-ü" and got.dropped_ids == tuple(dropped)
    assert got.input_ids.tolist() == [5, 6, 7] and got.loss_mask.tolist() == [True, True, False]


@pytest.mark.parametrize("head, body, problem", [
    ([-1, 0], [], "sent a malformed HELLO header"),
    ([2, 3], [torch.tensor([1, 1]), torch.tensor([97, 255, 98], dtype=torch.uint8)],
     "whose id lengths [1, 1] do not add up to its 3 id bytes"),
    ([1, 1], [torch.tensor([1]), torch.tensor([97], dtype=torch.uint8), torch.tensor([-2])],
     "sent a HELLO with a negative token count (-2)"),
    ([1, 2], [torch.tensor([2]), torch.tensor([0xC3, 0x28], dtype=torch.uint8)], "whose ids are not UTF-8"),
])
def test_a_malformed_resume_state_is_a_wire_error_naming_the_trainer(monkeypatch, head, body, problem):
    """A HELLO with a negative id count raised torch's "negative dimension" error, one whose
    ids were not UTF-8 a UnicodeDecodeError, and lengths that did not add up cut the ids
    silently (the producer then skipped the wrong samples): the producer's listener now
    keeps a WireError naming trainer rank 2."""
    wire, _ = _loopback(monkeypatch)
    wire.append(T._header(T.HELLO, head))
    wire.extend(body)
    listener = T.AckListener([2], group=None)
    with pytest.raises(T.WireError) as caught:
        listener.result()
    text = str(caught.value)
    assert text.startswith("rank 2 sent ") and problem in text, text
    listener.join(5)
    # a well-formed one
    wire.clear()
    T.send_hello({"a": 12, "b-ü": None}, 2, group=None)
    T.send_ack(2, 0, stop=True, group=None)
    listener = T.AckListener([2], group=None)
    assert listener.result() == {"a": 12, "b-ü": None}
    listener.join(5)


# --------------------------------------------------------------------------- the end of a run


def test_a_lost_target_after_the_last_step_is_logged_on_the_ranks_line(monkeypatch, capsys):
    """The warning that a target died after the trainer's last step was printed bare, the
    one trainer line without its "[rank N trainer]" prefix; it now goes through the rank's
    log (the trainer passes ctx.log), once."""
    from draftforge.splitserve.consumer import ConsumerStream
    from draftforge.splitserve.roles import _say

    _loopback(monkeypatch, dead={0})
    receiver = T.SampleReceiver([0], credits=2)
    stream = ConsumerStream(receiver, ack_group=None, acks=T.AckLink([0], group=None, every_s=3600),
                            log=_say(4, "trainer"))
    assert stream.stop(timeout_s=5) == 0
    err = capsys.readouterr().err
    expected = ("[rank 4 trainer] warning: after this trainer's last step, target rank 0 died or "
                f"closed its connection: {CLOSED} (while telling it to stop); its steps are done, "
                "the stream's end not waited for\n")
    assert err == expected


def test_the_live_targets_are_drained_when_another_dies_after_the_last_step(monkeypatch):
    """A trainer fed by target ranks 0, 1 and 2; rank 0 died after its last step. The
    receive thread met rank 0's closed connection and ended, so stop() drained nothing:
    rank 1's last sample and END, and rank 2's END, found no receive, and once the trainer
    exited those targets failed with "trainer rank 3 died or closed its connection (while
    sending end-of-stream)" (a real 3-rank gloo job: the live target exited with status 3,
    telling the user to resume a finished run). Now the others are received to their END."""
    from draftforge.splitserve.consumer import ConsumerStream

    wire, headers = _loopback(monkeypatch, dead={0})
    # what ranks 1 and 2 still send: rank 1 a sample in flight and its END, rank 2 its END
    T.send_sample(3, "late", torch.arange(4), torch.ones(4, dtype=torch.bool), torch.zeros(4, 2),
                  torch.zeros(4, 2), seq_no=5)
    T.send_end(3)
    T.send_end(3)
    in_flight = len(wire)
    receiver = T.SampleReceiver([0, 1, 2], credits=2)
    deadline = time.monotonic() + 10
    while receiver.error is None and time.monotonic() < deadline:  # the thread meets rank 0's death
        time.sleep(0.01)
    assert isinstance(receiver.error, T.PeerDied) and len(wire) == in_flight  # nothing of 1, 2 taken
    stream = ConsumerStream(receiver, ack_group=None, acks=T.AckLink([0, 1, 2], group=None, every_s=3600),
                            log=lambda text: None)
    assert stream.stop(timeout_s=5) == 1  # rank 1's sample, dropped
    # everything ranks 1 and 2 sent was received; only the stop ACKs to them remain
    assert [(int(t[1]), t[2:4].tolist()) for t in wire] == [(T.ACK, [0, 1]), (T.ACK, [0, 1])]
    assert [dst for dst, kind, _ in headers if kind == T.ACK] == [1, 2]
    assert stream.warning.startswith("warning: after this trainer's last step, target rank 0 died")


def test_another_target_lost_in_that_drain_is_a_second_warning(monkeypatch):
    """Ranks 0 and 2 dead, rank 1 live: rank 1 is drained to its END, and rank 2, whose
    drain meets its closed connection, is named on a line of its own."""
    from draftforge.splitserve.consumer import ConsumerStream

    wire, _ = _loopback(monkeypatch, dead={0, 2})
    T.send_end(3)  # rank 1's
    receiver = T.SampleReceiver([0, 1, 2], credits=2)
    deadline = time.monotonic() + 10
    while receiver.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    lines: list[str] = []
    stream = ConsumerStream(receiver, ack_group=None, acks=T.AckLink([0, 1, 2], group=None, every_s=3600),
                            log=lines.append)
    assert stream.stop(timeout_s=5) == 0
    assert [(int(t[1]), t[2:4].tolist()) for t in wire] == [(T.ACK, [0, 1])]  # rank 1's END taken
    assert lines == [
        stream.warning,
        f"warning: after this trainer's last step, target rank 2 died or closed its connection: {CLOSED} "
        "(while waiting for a sample); that stream's end not waited for either",
    ]
    assert stream.warning.startswith("warning: after this trainer's last step, target rank 0 died")


# --------------------------------------------------------------------------- the split advice


def _warm_up_run(monkeypatch, *, warm_up_s: float, steps: int = 50):
    """1 target rank feeding 3 trainers, on a fake clock, as this trainer sees it: every step
    trains one 520-token sample here in 0.2 s of compute (2600 tok/s), the target computes the
    3 trainers' 1560 tokens in 0.39 s (4000 tok/s) and sets the pace (the trainer waits 0.19 s
    a step); the first step's compute adds ``warm_up_s`` (a compile of the objective)."""
    from draftforge.splitserve import accounting as A

    clock = [0.0]
    monkeypatch.setattr(A, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    acc = A.ConsumerAccounting(world=4, num_target=1, credits=8)
    busy = idle = tokens = 0.0
    for step in range(steps):
        compute = 0.2 + (warm_up_s if step == 0 else 0.0)
        wait = 0.39 if step == 0 else 0.19  # the first waits for the whole first chunk
        acc.on_take(depth=1, tokens=520, waited_s=wait, sample_id=f"s{step}")
        clock[0] += wait + compute
        busy, tokens = busy + 0.39, tokens + 1560
        idle = clock[0] - busy  # the rest of the target's wall: waiting for credits
        acc.on_producer_stats(0, {"busy_s": busy, "idle_s": idle, "wall_s": clock[0], "tokens": tokens})
        acc.on_step({"compute_s": compute, "wait_s": wait, "sample_ids": [f"s{step}"]})
    return acc


def _best_split(producer: float, consumer: float) -> tuple[int, int, float]:
    """The 4-rank split with the fastest slower side, by hand: 1 target feeds 3 trainers
    alone, 2 feed 2 one each, 3 feed 1 together."""
    rates = {(1, 3): min(producer, 3 * consumer), (2, 2): min(2 * producer, 2 * consumer),
             (3, 1): min(3 * producer, consumer)}
    best = max(rates, key=rates.get)
    return (*best, rates[best])


def test_the_split_advice_is_judged_after_the_first_steps_warm_up(monkeypatch):
    """A 50-step run whose first step compiled the objective for 20 s. The target is the
    slower side (4000 tok/s against 3 x 2600 of the trainers), and 2 + 2 ranks would feed 5200
    tok/s against 4000 now. Over the whole run the compile cut the trainer's capacity to 866
    tok/s: the summary said "slower side: trainer", and recommended the split the run already
    had (1 + 3), expecting 2600 tok/s. Judged after the first step (as the credit advice is)."""
    acc = _warm_up_run(monkeypatch, warm_up_s=20.0)
    s = acc.snapshot()
    assert s["consumer"]["capacity_tok_s"] == pytest.approx(50 * 520 / (50 * 0.2 + 20))  # printed: the whole run
    target_ranks, trainer_ranks, expected = _best_split(1560 / 0.39, 520 / 0.2)
    assert (target_ranks, trainer_ranks, expected) == (2, 2, pytest.approx(5200))
    assert s["recommended"] == {"target_ranks": 2, "trainer_ranks": 2, "expected_tok_s": pytest.approx(5200)}
    assert ("  slower side: target; recommended split for 4 ranks: 2 target + 2 trainer (now 1 target "
            "+ 3 trainer); judged after the first step (warm-up): capacity target 4000, trainer 2600 "
            "tok/s") in acc.summary_text().splitlines()
    # without a warm-up the whole run says the same
    acc = _warm_up_run(monkeypatch, warm_up_s=0.0)
    assert acc.snapshot()["recommended"]["target_ranks"] == 2
    assert "slower side: target; recommended split for 4 ranks: 2 target + 2 trainer" in acc.summary_text()


def test_a_run_of_one_step_is_judged_on_its_whole_run(monkeypatch):
    """Nothing measured after the first step: the advice keeps the whole run's capacities."""
    acc = _warm_up_run(monkeypatch, warm_up_s=0.0, steps=1)
    s = acc.snapshot()
    producer, consumer = s["producer"]["capacity_tok_s"], s["consumer"]["capacity_tok_s"]
    assert (producer, consumer) == (pytest.approx(4000), pytest.approx(2600))
    best = _best_split(producer, consumer)
    assert s["recommended"] == {"target_ranks": best[0], "trainer_ranks": best[1],
                                "expected_tok_s": pytest.approx(best[2])}
