"""Review round 14 of SplitServe streaming, transport, bench split, dry run and accounting."""

from __future__ import annotations

import time
import types
from collections import deque

import pytest
import torch

from draftforge.splitserve import transport as T

CLOSED = "Connection closed by peer [127.0.0.1]:41234"  # what gloo says of a dead peer


def _loopback(monkeypatch, dead: set[int] = frozenset(), gone: set[int] = frozenset()
              ) -> tuple[deque, list]:
    """Point-to-point sends into a FIFO that the receives read from (one process); a send to
    or a receive from a rank in ``dead`` fails as gloo's does for a closed connection, a
    receive from one in ``gone`` too (a send still lands in the socket's buffer). Returns
    the FIFO and the list of (destination, header kind, values) of every header sent."""
    wire: deque[torch.Tensor] = deque()
    headers: list = []

    def send(tensor, dst, group=None):
        if dst in dead:
            raise RuntimeError(CLOSED)
        if tensor.dtype == torch.int64 and tensor.numel() == T.HEADER_LEN and int(tensor[0]) == T.MAGIC:
            headers.append((dst, int(tensor[1]), tensor[2:].tolist()))
        wire.append(tensor.clone())

    def recv(tensor, src=None, group=None):
        if src in dead or src in gone:
            raise RuntimeError(CLOSED)
        sent = wire.popleft()
        assert sent.dtype == tensor.dtype and sent.shape == tensor.shape, (sent.shape, tensor.shape)
        tensor.copy_(sent)
        return src

    monkeypatch.setattr(T, "dist", types.SimpleNamespace(send=send, recv=recv))
    return wire, headers


# --------------------------------------------------------------------------- the end of a run


def test_a_target_that_dies_after_the_last_step_does_not_fail_the_finished_trainer(monkeypatch, capsys):
    """Trainer fed by target ranks 0 and 1; rank 0 died after the trainer's last step (the
    receive thread met its closed connection). stop() raised PeerDied from the stop ACK to
    rank 0, so rank 1 was never told to stop, and the trainer's finished run (steps done,
    final checkpoint written) exited as failed without writing its accounting summary. Now
    every live producer gets its stop, the drain ends, and a warning names the dead rank."""
    from draftforge.splitserve.consumer import ConsumerStream

    _, headers = _loopback(monkeypatch, dead={0})
    receiver = T.SampleReceiver([0, 1], credits=2)
    deadline = time.monotonic() + 10
    while receiver.error is None and time.monotonic() < deadline:  # the thread meets rank 0's death
        time.sleep(0.01)
    acks = T.AckLink([0, 1], group=None, every_s=3600)
    stream = ConsumerStream(receiver, ack_group=None, acks=acks)
    assert stream.stop(timeout_s=5) == 0
    assert [(dst, kind, values[:2]) for dst, kind, values in headers] == [(1, T.ACK, [0, 1])]
    warning = ("warning: after this trainer's last step, target rank 0 died or closed its "
               f"connection: {CLOSED} (while telling it to stop); its steps are done, the "
               "stream's end not waited for")
    assert stream.warning == warning
    assert warning in capsys.readouterr().err
    assert stream.stop() == 0  # once only


def test_a_single_target_lost_in_the_drain_is_a_warning_too(monkeypatch, capsys):
    """The stop ACK went out (into the socket's buffer), then the drain met the closed
    connection: the receive thread's PeerDied was raised from stop() before the summary."""
    from draftforge.splitserve.consumer import ConsumerStream

    _, headers = _loopback(monkeypatch, gone={0})
    receiver = T.SampleReceiver([0], credits=2)
    stream = ConsumerStream(receiver, ack_group=None, acks=T.AckLink([0], group=None, every_s=3600))
    assert stream.stop(timeout_s=5) == 0
    assert [(dst, kind, values[:2]) for dst, kind, values in headers] == [(0, T.ACK, [0, 1])]
    assert stream.warning == (
        "warning: after this trainer's last step, target rank 0 died or closed its connection: "
        f"{CLOSED} (while waiting for a sample); its steps are done, the stream's end not waited for")
    assert stream.warning in capsys.readouterr().err


def test_a_target_that_died_before_the_stop_is_named_by_the_ack_link():
    """The stop ACK to a dead producer still raises PeerDied naming it (after the live
    producers were told), so a run still mid-stream keeps reporting the death."""
    sent = []

    def send(tensor, dst, group=None):
        if dst == 2:
            raise RuntimeError(CLOSED)
        sent.append(dst)

    original = T.dist
    T.dist = types.SimpleNamespace(send=send)
    try:
        acks = T.AckLink([2, 0, 1], group=None, every_s=3600)
        with pytest.raises(T.PeerDied, match="target rank 2 died or closed its connection"):
            acks.stop()
    finally:
        T.dist = original
    assert sent == [0, 1]


# --------------------------------------------------------------------------- the wire


@pytest.mark.parametrize("values, problem", [
    ([99, 2, 3, 4], "dtype code 99"),  # a dtype this version does not know
    ([2, 7, 1, 1, 1, 1, 1, 1, 1], "at most 4 dimensions"),
    ([2, 2, -3, 4], "none negative"),
])
def test_a_malformed_tensor_header_is_a_wire_error_naming_the_sender(monkeypatch, values, problem):
    """A TENSOR header with an unknown dtype code raised a bare KeyError (99), with 7
    dimensions or a negative size a torch error about torch.empty: neither says that rank 0
    sent something this version cannot read."""
    wire, _ = _loopback(monkeypatch)
    wire.append(T._header(T.TENSOR, values))
    with pytest.raises(T.WireError) as caught:
        T.recv_tensor(0, what="the target's embeddings")
    text = str(caught.value)
    assert text.startswith("rank 0 sent a malformed tensor header") and problem in text
    assert "the target's embeddings" in text
    # a good header still comes through
    tensor = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    T.send_tensor(tensor, 1)
    got = T.recv_tensor(0)
    assert got.dtype == torch.float16 and torch.equal(got, tensor)


# --------------------------------------------------------------------------- accounting


def _accounting(monkeypatch, *, credits: int, per_step: int, trainer_wait: float, target_idle: float,
                fill_s: float = 5.0, steps: int = 5):
    """A run on a fake clock: the first step waits ``fill_s`` for the target's first chunk
    (the target busy meanwhile) and computes 1 s; every later step takes 1 s, of which the
    trainer waits ``trainer_wait`` and the target idles ``target_idle``; ``per_step``
    samples of 100 tokens a step. Returns the accounting and the whole run's idle shares."""
    from draftforge.splitserve import accounting as A

    clock = [0.0]
    monkeypatch.setattr(A, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    acc = A.ConsumerAccounting(world=2, num_target=1, credits=credits)
    busy = idle = tokens = 0.0
    for step in range(steps):
        seconds, wait = (fill_s + 1.0, fill_s) if step == 0 else (1.0, trainer_wait)
        ids = [f"s{step}-{k}" for k in range(per_step)]
        for sample_id in ids:
            acc.on_take(depth=1, tokens=100, waited_s=0.0, sample_id=sample_id)
        clock[0] += seconds
        step_idle = 0.0 if step == 0 else target_idle
        busy, idle, tokens = busy + seconds - step_idle, idle + step_idle, tokens + 100 * per_step
        acc.on_producer_stats(0, {"busy_s": busy, "idle_s": idle, "wall_s": clock[0], "tokens": tokens})
        acc.on_step({"compute_s": seconds - wait, "wait_s": wait, "sample_ids": ids})
    whole_trainer = (fill_s + (steps - 1) * trainer_wait) / clock[0]
    whole_target = (steps - 1) * target_idle / clock[0]
    return acc, whole_trainer, whole_target


def test_the_credit_advice_is_judged_in_the_steady_state_not_on_the_pipelines_fill(monkeypatch):
    """A short run whose trainer is the slower side: 6 % idle once the pipeline is full, the
    target 40 % idle waiting for credits, 4 samples a step against 4 credits. Over the whole
    run the first step's 5 s wait for the target's first chunk made the trainer 52 % idle,
    and the summary advised raising split.max_in_flight (a step "took 4.0 samples" and the
    credits "hold 4", though the trainer already holds the next batch's first sample)."""
    acc, whole_trainer, whole_target = _accounting(monkeypatch, credits=4, per_step=4,
                                                   trainer_wait=0.06, target_idle=0.4)
    s = acc.snapshot()
    assert s["consumer"]["idle_share"] == pytest.approx(whole_trainer) == pytest.approx(0.524)
    assert s["producer"]["idle_share"] == pytest.approx(whole_target) == pytest.approx(0.16)
    assert acc.credit_advice(s) is None
    assert "both sides waited" not in acc.summary_text()
    # the same run with 8 credits: no advice either way
    acc, _, _ = _accounting(monkeypatch, credits=8, per_step=4, trainer_wait=0.06, target_idle=0.4)
    assert acc.credit_advice(acc.snapshot()) is None


def test_a_step_of_exactly_the_credits_gets_no_credit_advice(monkeypatch):
    """Both sides 25 % idle in the steady state: with 8 samples a step the 4 credits are too
    few (the advice, with the steady figures), with 4 they are enough: the packer took the
    next batch's first sample to close a batch, so 4 more close the next one."""
    acc, _, _ = _accounting(monkeypatch, credits=4, per_step=8, trainer_wait=0.25, target_idle=0.25)
    assert acc.summary_text().splitlines()[-1] == (
        "  both sides waited (target idle 25%, trainer idle 25%): a step took 8.0 samples and "
        "the trainer's credits hold 4, so the target cannot work a step ahead; raise "
        "split.max_in_flight to about 16")
    acc, _, _ = _accounting(monkeypatch, credits=4, per_step=4, trainer_wait=0.25, target_idle=0.25)
    assert acc.credit_advice(acc.snapshot()) is None
    assert "both sides waited" not in acc.summary_text()


# --------------------------------------------------------------------------- uneven splits


def _lockstep_rate(topology, capacity: float) -> float:
    """The target side's rate from the topology itself: the trainers step in lockstep on equal
    shares, so the producer owning the largest share of the order's positions sets the pace."""
    from fractions import Fraction
    from math import lcm

    positions = len(topology.trainers) * lcm(*range(1, len(topology.producers) + 1))
    owners = [topology.producer_of(n) for n in range(positions)]
    largest = max(Fraction(owners.count(p), positions) for p in topology.producers)
    return float(Fraction(capacity) / largest)


@pytest.mark.parametrize("num_p, num_r", [(3, 2), (5, 3), (4, 3), (2, 3), (3, 5), (2, 2), (1, 3)])
def test_bench_split_takes_the_producers_rate_the_trainers_can_take(num_p, num_r):
    """Phase 1: each target rank at 100 tok/s computes 1000 tokens for each of its trainers.
    The result summed them over the slowest one's wall: 3 targets feeding 2 trainers read
    300 tok/s, though trainer 4, fed by one target, holds both trainers (lockstep) to 100 tok/s
    each, 200 in all; the ratio then blamed the pipeline for the topology."""
    from draftforge.splitserve.bench_split import bench_result, report
    from draftforge.splitserve.producer import Topology

    topology = Topology(producers=tuple(range(num_p)), trainers=tuple(range(num_p, num_p + num_r)))
    tokens = [1000.0 * len(topology.dests(p)) for p in topology.producers]
    walls = [t / 100.0 for t in tokens]
    summed = sum(tokens) / max(walls)
    expected = _lockstep_rate(topology, 100.0)
    # (prod tokens, prod wall, cons tokens, cons wall, both tokens, both wall, trainer wait,
    #  target idle, steady tok/s, steady chunks, no steady, steady trainer idle)
    values = [sum(tokens), max(walls), 1e6, 1.0, 190.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    result = bench_result(5, values, topology=topology)
    assert result["producer_tok_s"] == pytest.approx(expected)
    assert result["split_efficiency"] == pytest.approx(190.0 / expected)
    first = report(result).splitlines()[0]
    if expected < summed - 1e-6:
        assert result["producer_summed_tok_s"] == pytest.approx(summed)
        assert first == (f"producer alone            : {expected:8.1f} tok/s (what the trainers, in "
                         f"lockstep, can take of the target ranks' {summed:.1f}: they feed the "
                         "trainers unevenly)")
    else:
        assert "producer_summed_tok_s" not in result
        assert first == f"producer alone            : {expected:8.1f} tok/s"
    assert bench_result(5, values)["producer_tok_s"] == pytest.approx(summed)  # no topology: the sum


def _dry_run_split_lines(tmp_path, targets: list[int], trainers: list[int]) -> list[str]:
    from splitserve_helpers import tiny_recipe

    from draftforge.config import load_recipe
    from draftforge.splitserve.dry_run import dry_run

    folder = tmp_path / f"{len(targets)}-{len(trainers)}"
    folder.mkdir()
    cfg = load_recipe(tiny_recipe(folder, trainers=len(trainers), overrides={
        "split.target_ranks": targets, "split.trainer_ranks": trainers}))
    text = dry_run(cfg)
    block = text[text.index("\nsplit:\n  world size"):]
    return block[: block.index("\n\n")].splitlines()


def test_the_dry_run_says_which_rank_sets_the_pace_of_an_uneven_split(tmp_path):
    """2 target ranks feeding 3 trainers printed "target rank 0 feeds trainer ranks [2, 4]" and
    "target rank 1 feeds trainer ranks [3]" and nothing about the rate: target 0 makes two
    thirds of the tokens, so the pair feeds 1.5 x one target's rate, not 2 x. 3 targets for 2
    trainers: trainer 4 has one target where trainer 3 has two: 2 x, not 3 x."""
    from draftforge.splitserve.producer import Topology

    for targets, trainers, note in (
        ([0, 1], [2, 3, 4], "so target rank 0, feeding 2 trainer ranks where another feeds 1, "
                            "sets the pace: the target side feeds at most 1.5 x one target rank's "
                            "rate, not 2 x"),
        ([0, 1, 2], [3, 4], "so trainer rank 4, fed by 1 target rank where another gets 2, sets "
                            "the pace: the target side feeds at most 2 x one target rank's rate, "
                            "not 3 x"),
    ):
        lines = _dry_run_split_lines(tmp_path, targets, trainers)
        assert lines[-2] == ("  uneven: the trainer ranks step in lockstep on equal shares of the "
                             f"data, {note}")
        factor = _lockstep_rate(Topology(tuple(targets), tuple(trainers)), 1.0)
        assert f"at most {factor:g} x" in note
    lines = _dry_run_split_lines(tmp_path, [0, 1], [2, 3, 4, 5])  # even: nothing to say
    assert not any("uneven" in line for line in lines)
    assert lines[-3:-1] == ["  target rank 0 feeds trainer ranks [2, 4]",
                            "  target rank 1 feeds trainer ranks [3, 5]"]


def test_the_dry_run_says_what_a_trainer_fed_by_several_targets_holds(tmp_path):
    """split.max_in_flight=5 with 3 targets and 2 trainers: trainer 3, fed by targets 0 and 2,
    gets 5 // 2 = 2 credits per link, 4 in all (its accounting's queue bound says 4), but the
    dry run said "credits: 5 samples in flight per trainer"."""
    from splitserve_helpers import tiny_recipe

    from draftforge.config import load_recipe
    from draftforge.splitserve.dry_run import dry_run
    from draftforge.splitserve.producer import build_topology

    cfg = load_recipe(tiny_recipe(tmp_path, trainers=2, overrides={
        "split.target_ranks": [0, 1, 2], "split.trainer_ranks": [3, 4], "split.max_in_flight": 5}))
    topology = build_topology(cfg.split)
    held = {r: len(topology.sources(r)) * (5 // len(topology.sources(r))) for r in (3, 4)}
    assert held == {3: 4, 4: 5}
    assert ("  credits: 5 samples in flight per trainer (a trainer fed by 2 target ranks: 2 per "
            "link, 4 in all); batches of 256 padded tokens") in dry_run(cfg).splitlines()
