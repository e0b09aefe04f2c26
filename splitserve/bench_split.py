"""``draftforge bench split RECIPE [key=value ...] [--steps N]``: is the split well balanced?

One job with the recipe's split (started like draftforge train, loopback only) runs three phases:

1. **producer alone**: each target rank computes its first samples without sending
   anything, timed over a window like phase 3's steady one (:func:`producer_window`): from
   the end of its first chunk to a later chunk end, enough tokens for ``N + 1`` steps of
   its trainers;
2. **consumer alone**: those samples are moved to the trainers (untimed) and
   each trainer runs ``N`` steps from memory (after one untimed warm-up step);
3. **both**: the normal stream, producer and trainers together, ``N + 1`` steps
   from an empty pipeline. Two rates come out of it:

   - **steady** (the end-to-end rate of the ratio): per producer link, the tokens
     trained by the steps after the one that took the first chunk's last sample,
     up to and including the one that took the last complete chunk's last
     sample, over the time those steps took. Both ends sit at the same point of
     the chunk cycle (each boundary step also trains what follows its chunk end:
     the window leaves it out at the start and keeps it at the end, so it counts
     exactly what its steps trained), so the pipeline's latency cancels: a chunk reaches the
     trainer only once it is generated and featurised whole, and the trainer's
     in-order packer closes the batch holding a chunk's last sample only when the
     next chunk's first sample arrives. That latency is about one chunk's time,
     paid once per run (at the CPU recipe's 40 steps it was one chunk in ten: the
     from-empty rate read 0.88 of the producer while generation ran at the same
     speed as alone).

     With ``split.reuse_features`` the stream interleaves epochs 0 and 1 chunk by chunk
     (0/0, 0/1, 1/0, 0/2, 1/1, ...): an epoch-1 visit re-sends features its epoch-0 visit
     computed and costs the target next to nothing. Both windows (this one and phase 1's)
     then close only where they hold as many epoch-1 visits as epoch-0 ones
     (:class:`PairedVisits`), as the stream does in the long run; one closed after an
     epoch-0 visit holds a computed chunk more than re-sent ones and reads the target's
     rate low (phase 1's used to time chunk 0 too: 8 chunks held 5 computed and 3
     re-sent, about 0.8 of the stream's rate, so ``split_efficiency`` read high where the
     target is the slower side).

     The window's chunks are not the ones phase 1 averaged over, and chunks differ
     in length and generation time (9 to 16 s at the CPU recipe), so the figure
     carries a few per cent of noise either way (0.986, 1.020 and 0.968 in three
     runs of the CPU recipe) and needs several chunks: with fewer than
     :data:`MIN_STEADY_CHUNKS` per link there is no steady rate (10 steps of the
     CPU recipe span one, whose rate read 1.49 of the producer's average).
   - **from empty**: all tokens of the ``N + 1`` steps over their time, latency
     included, printed for comparison, and the ratio's rate when there is no
     steady one.

Rates are tokens per second summed over the group's ranks, except that the producers'
is what the trainers can take of it: they step in lockstep on equal shares, so where the
target ranks do not divide the trainers evenly (3 targets feeding 2 trainers) the least fed
trainer sets the pace (:func:`~draftforge.splitserve.accounting.feed_rate`; the sum is
printed beside it). It prints
``end-to-end / min(producer, consumer)``; the last line is machine-readable::

    split_efficiency=<ratio> trainer_idle=<share> target_idle=<share>

The idle shares are those of phase 3 (trainer: waiting for samples; target: waiting for
credits or for its turn at a trainer, from its reports on the wire), each over the
steady window when there is one, else over all steps (the target's: its whole phase),
as defined in :mod:`draftforge.splitserve.accounting`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from draftforge.errors import InputError
from draftforge.files import write_atomic
from draftforge.splitserve import transport as T
from draftforge.splitserve.accounting import Meter, feed_rate

RESULT_ENV = "DRAFTFORGE_BENCH_OUT"
MIN_STEADY_CHUNKS = 4  # whole chunks per link in the steady window


# --------------------------------------------------------------------------- ranks


def _token_goal(ctx, dests: int, steps: int) -> int:
    train = ctx.cfg.train
    return (steps + 1) * train.grad_accum * ctx.cfg.split.token_budget * dests


def bench_target_rank(ctx, engine, bench: dict, *, pulse: T.Pulse, hellos: T.AckListener) -> None:
    """The target rank's side of the three phases.

    ``pulse`` and ``hellos``: the rank's heartbeat on the data links and its listener on the
    ack group, both running since the rank started. Each trainer says (HELLO) when it waits
    for phase 1's samples, and again when it is done with phase 2; meanwhile its heartbeat
    reaches ``hellos``, and a trainer fed by this rank alone gets this rank's beats while it
    waits (as in a training run, one fed by several producers gets none, see
    :mod:`~draftforge.splitserve.transport`)."""
    from draftforge.splitserve.producer import run_producer

    steps = int(bench["steps"])
    dests = ctx.topology.dests(ctx.rank)
    lone = [dest for dest in dests if len(ctx.topology.sources(dest)) == 1]

    def ready(dest: int) -> bool:  # the trainer receives on the link: it has said so
        with hellos.cond:
            return dest in hellos.hello_from

    pulse.expect(lone, listens=ready, on_error=hellos.fail)
    ctx.log(f"bench phase 1: producer alone ({steps + 1} steps' worth of tokens)")
    _warm_up(ctx, engine)
    meter = Meter()
    samples, tokens, seconds = producer_window(ctx.cfg, engine, topology=ctx.topology, rank=ctx.rank,
                                               min_tokens=_token_goal(ctx, len(dests), steps),
                                               meter=meter)
    hellos.result()  # every trainer waits for them now, each until its END
    pulse.expect(lone, on_error=hellos.fail)
    with hellos.cond:  # phase 3 starts at each trainer's next HELLO, sent once it has its END
        hellos.hello_from.clear()
    stats = torch.tensor([tokens, int(seconds * 1e6)])
    for dest in dests:
        with pulse.lock:
            T.send_tensor(stats, dest, group=ctx.data_group, device=ctx.device,
                          what="phase 1's rate")
    ctx.log(f"  {tokens} tokens in {seconds:.1f} s (whole chunks after the first; all chunks: "
            f"{_parts(meter.busy_by)}); moving samples to the trainers")
    for seq_no, sample in enumerate(samples):
        with pulse.lock:
            T.send_sample(sample.dest, sample.sample_id, sample.input_ids, sample.loss_mask,
                          sample.aux, sample.final, seq_no=seq_no, group=ctx.data_group,
                          device=ctx.device)
    for dest in dests:
        with pulse.lock:
            T.send_end(dest, group=ctx.data_group, device=ctx.device)
            pulse.waiting.discard(dest)  # it trains from memory now, receiving nothing here
    del samples
    ctx.log("  waiting for the trainers to finish phase 2 (trainer alone)")
    hellos.result()
    ctx.log("bench phase 3: producer and trainers together")
    summary = run_producer(ctx.cfg, engine, ctx.topology, ctx.rank, data_group=ctx.data_group,
                           ack_group=ctx.ack_group, device=ctx.device, log=ctx.log, pulse=pulse,
                           hellos=hellos)
    ctx.log(f"  target idle {summary['idle_share']:.1%}; busy {_parts(summary['busy_by_part_s'])} "
            "(to the end of the stream, past the timed window)")


class PairedVisits:
    """Where a window over a producer's stream, opened at the end of its first chunk, may close.

    Without ``paired`` (``split.reuse_features`` off, or no epoch 1), at any chunk end. With
    it, epochs 0 and 1 interleave (0/0, 0/1, 1/0, 0/2, 1/1, ...:
    :func:`~draftforge.splitserve.producer.epoch_rounds`) and an epoch-1 visit re-sends
    features computed in epoch 0: the window closes only at the end of a visit that leaves
    it with as many epoch-1 visits as epoch-0 ones (1/k, which leaves 0/1 ... 0/k+1 and
    1/0 ... 1/k in it), or in epoch 2 or later, where every visit computes its features."""

    def __init__(self, paired: bool) -> None:
        self.paired = paired
        self.counts = [0, 0]  # epoch-0 and epoch-1 visits since the window opened

    def close_after(self, epoch: int) -> bool:
        """Count a visit of ``epoch`` that ended; whether the window may close after it."""
        if epoch < 2:
            self.counts[epoch] += 1
        return not self.paired or epoch >= 2 or self.counts[0] == self.counts[1]


def producer_window(cfg, engine, *, topology, rank: int, min_tokens: int, meter: Meter | None = None):
    """This producer's first samples (no wire), and the tokens and seconds of its timed window.

    The window opens once the stream's first chunk is out (its time stays out, as phase 3's
    steady window leaves it out; with ``split.reuse_features`` its features are re-sent only
    two visits later) and closes at the end of a chunk once it holds at least ``min_tokens``
    tokens, where :class:`PairedVisits` lets it: nothing of the next chunk is computed. The
    samples returned are all of them, the first chunk's too. A stream of a single chunk
    (``split.max_epochs``) is timed whole; one that ends before the window may close, as far
    as it goes."""
    from draftforge.splitserve.producer import (
        SampleSource,
        id_epoch,
        launch_pin,
        load_source_conversations,
    )

    conversations, regenerate = load_source_conversations(cfg, pinned=launch_pin())
    source = SampleSource(cfg, engine, topology, rank, conversations=conversations,
                          regenerate=regenerate, meter=meter)
    visits = PairedVisits(cfg.split.keeps_features)
    out: list = []
    start = time.perf_counter()
    opened: float | None = None
    tokens = everything = 0
    for sample in source.samples():
        out.append(sample)
        everything += sample.num_tokens
        if opened is None:
            if sample.chunk_last:
                opened = time.perf_counter()
            continue
        tokens += sample.num_tokens
        if sample.chunk_last and visits.close_after(id_epoch(sample.sample_id)) and tokens >= min_tokens:
            break
    if opened is None or not tokens:  # a single chunk: timed whole
        return out, everything, time.perf_counter() - start
    return out, tokens, time.perf_counter() - opened


def _parts(seconds_by_part: dict) -> str:
    return ", ".join(f"{part} {seconds:.1f} s" for part, seconds in seconds_by_part.items())


def _warm_up(ctx, engine) -> None:
    """One small untimed generate and features call: first-call costs (kernel selection,
    allocator growth) belong to neither phase."""
    if ctx.cfg.data.regenerate:
        settings = ctx.cfg.target.generation.model_copy(update={"max_new_tokens": 4})
        engine.generate([[{"role": "user", "content": "Hello"}]], settings)
    ids = torch.full((1, 16), 1, dtype=torch.long, device=ctx.device)
    engine.features(ids)


@dataclass
class StepRecord:
    """One optimizer step of phase 3: when it ended, and what it took from each link."""

    end_s: float  # seconds from the start of the phase
    samples: list[tuple[int, int, bool, int]]  # (source rank, tokens, chunk_end, epoch) in consumption order
    wait_s: float = 0.0  # the trainer's wait for samples since the start of the phase
    producer: tuple[float, float] = (0.0, 0.0)  # the producers' running (idle s, wall s) then


def _recorded_steps(trainer, batches, steps: int, grad_accum: int,
                    waited=lambda: 0.0, producer=lambda: (0.0, 0.0)) -> list[StepRecord]:
    """Run ``steps`` optimizer steps from ``batches``; ``waited()`` is the trainer's total
    wait for samples so far (none when training from memory), ``producer()`` the
    producers' running (idle, wall) seconds."""
    from draftforge.splitserve.producer import id_epoch

    records = []
    begin, wait_before = time.perf_counter(), waited()
    for step in range(steps):
        try:
            micro = [next(batches) for _ in range(grad_accum)]
        except StopIteration:  # only the stream of phase 3 ends; memory cycles
            raise InputError(
                f"bench split: the data ended after {step} of the {steps} steps phase 3 needs "
                "(split.max_epochs, or too few samples); add data, drop split.max_epochs or "
                "lower --steps") from None
        trainer.train_step(micro)
        taken = [(s.provenance.get("target_rank", -1), s.num_tokens,
                  bool(s.provenance.get("chunk_end")), id_epoch(s.sample_id))
                 for batch in micro for s in batch]
        records.append(StepRecord(time.perf_counter() - begin, taken, waited() - wait_before, producer()))
    return records


def _totals(records: Sequence[StepRecord]) -> tuple[int, float]:
    """(real tokens, seconds) of all the recorded steps."""
    return sum(n for r in records for _, n, _, _ in r.samples), records[-1].end_s


@dataclass
class SteadyWindow:
    tok_s: float  # summed over links
    chunks: int  # whole chunks in the links' windows
    trainer_idle: float  # the trainer's wait share from the earliest window start to the latest end
    target_idle: float  # the producers' idle share over the same steps, from their wire reports


def steady_rate(records: Sequence[StepRecord], min_chunks: int = MIN_STEADY_CHUNKS, *,
                paired: bool = False) -> SteadyWindow | None:
    """Whole chunks, chunk end to chunk end: the rate summed over links, and the trainer's idle share.

    Per link, the window runs from the end of the step holding its first
    ``chunk_end`` sample to the end of the step holding its last one where the window
    may close (with ``paired``, ``split.reuse_features``: :class:`PairedVisits`, by the
    epoch of the chunk-end sample; else any); it counts the link's tokens trained by the
    steps inside it (all of each: the time of a step is that of all it trains). None when
    some link has fewer than ``min_chunks`` whole chunks between its first and last chunk ends.
    """
    ends: dict[int, list[tuple[int, int]]] = {}  # link -> [(step, sample index in the step)]
    visits: dict[int, PairedVisits] = {}
    closing: dict[int, int] = {}  # link -> how many of its chunk ends the window keeps
    for step, record in enumerate(records):
        for index, (src, _, chunk_end, epoch) in enumerate(record.samples):
            ends.setdefault(src, [])
            if chunk_end:
                ends[src].append((step, index))
                if len(ends[src]) == 1:  # the window opens here
                    visits[src] = PairedVisits(paired)
                elif visits[src].close_after(epoch):
                    closing[src] = len(ends[src])
    ends = {src: marks[: closing.get(src, 1)] for src, marks in ends.items()}
    if not ends:
        return None
    rate, chunks, begin, end = 0.0, 0, len(records), -1
    for src, marks in ends.items():
        if len(marks) - 1 < max(1, min_chunks) or marks[-1][0] <= marks[0][0]:
            return None
        first, last = marks[0][0], marks[-1][0]
        tokens = sum(count for step in range(first + 1, last + 1)
                     for link, count, _, _ in records[step].samples if link == src)
        rate += tokens / (records[last].end_s - records[first].end_s)
        chunks += len(marks) - 1
        begin, end = min(begin, first), max(end, last)
    span = records[end].end_s - records[begin].end_s
    (idle0, wall0), (idle1, wall1) = records[begin].producer, records[end].producer
    target_idle = (idle1 - idle0) / (wall1 - wall0) if wall1 > wall0 else 0.0
    return SteadyWindow(rate, chunks, (records[end].wait_s - records[begin].wait_s) / span, target_idle)


def _cycle(batches: list):
    while True:
        yield from batches


def bench_trainer_rank(ctx, trainer, bench: dict, *, acks: T.AckLink) -> None:
    """A trainer rank's side of the three phases; the first trainer rank writes the result.

    ``acks``: the rank's ack link, beating to its producers since the rank started; its
    HELLO tells them when this rank waits for phase 1's samples and when phase 2 is done."""
    from draftforge.splitserve.accounting import ConsumerAccounting
    from draftforge.splitserve.consumer import ConsumerStream, stream_pack
    from draftforge.train.sample import Sample, pack

    cfg, steps = ctx.cfg, int(bench["steps"])
    grad_accum = cfg.train.grad_accum
    sources = ctx.topology.sources(ctx.rank)
    prod_tokens, prod_wall = 0.0, 0.0
    samples = []
    acks.hello({})  # ready for phase 1's samples: a lone producer beats here from now on
    for src in sources:
        stats = T.recv_tensor(src, group=ctx.data_group, device=ctx.device,
                              what="phase 1's rate (the target computes alone)").tolist()
        if ctx.topology.dests(src)[0] == ctx.rank:  # count each producer once
            prod_tokens += stats[0]
            prod_wall = max(prod_wall, stats[1] / 1e6)
        while (wire := T.recv_sample(src, group=ctx.data_group, device=ctx.device)) is not None:
            samples.append(Sample(wire.sample_id, wire.input_ids, wire.loss_mask, wire.aux,
                                  wire.final))
    if not samples:
        raise InputError(f"bench split: trainer rank {ctx.rank} received no sample in phase 1 from "
                         f"target rank(s) {sources}; add data (data.num_samples) or drop "
                         "split.max_epochs")
    ctx.log(f"bench phase 2: trainer alone from memory ({len(samples)} samples, {steps} steps)")
    memory = _cycle(pack(samples, cfg.split.token_budget))
    trainer.model.train()
    _recorded_steps(trainer, memory, 1, grad_accum)  # warm-up, untimed
    cons_tokens, cons_wall = _totals(_recorded_steps(trainer, memory, steps, grad_accum))
    ctx.log(f"  {cons_tokens} tokens in {cons_wall:.1f} s (after one untimed warm-up step)")
    del samples, memory

    acks.hello({})  # phase 2 is done: phase 3 starts
    credits = max(1, cfg.split.max_in_flight // len(sources))
    accounting = ConsumerAccounting(world=ctx.world, num_target=len(cfg.split.target_ranks),
                                    tensor_parallel=cfg.split.target_tensor_parallel,
                                    credits=credits * len(sources), num_sources=len(sources))
    receiver = T.SampleReceiver(sources, credits=credits, group=ctx.data_group,
                                device=ctx.device)
    stream = ConsumerStream(receiver, ack_group=ctx.ack_group, accounting=accounting, acks=acks,
                            log=ctx.log)
    batches = stream_pack(stream.samples(), cfg.split.token_budget)
    # The N + 1 steps start from an empty pipeline, as phase 1 does (a window opened after a
    # fill step would eat samples produced before it and read faster than the producer). The
    # from-empty rate times them all; the steady rate times whole chunks inside them.
    records = _recorded_steps(trainer, batches, steps + 1, grad_accum, lambda: accounting.wait_s,
                              accounting.producer_idle_wall)
    trainer_wait = records[-1].wait_s
    both_tokens, both_wall = _totals(records)
    steady = steady_rate(records, paired=cfg.split.keeps_features)
    if steady is None:
        ctx.log(f"bench phase 3: a producer link completed fewer than {MIN_STEADY_CHUNKS + 1} "
                f"chunks in {steps + 1} steps: no steady rate, the ratio uses the from-empty rate "
                "(raise --steps)")
    steady_tok_s, steady_chunks, steady_idle = (
        (steady.tok_s, steady.chunks, steady.trainer_idle) if steady else (0.0, 0, 0.0))
    # the target's idle share over the ratio's window (the whole phase when there is none)
    target_idle = steady.target_idle if steady else accounting.snapshot()["producer"]["idle_share"]
    stream.stop(timeout_s=cfg.split.peer_timeout_s)

    values = torch.tensor([prod_tokens, prod_wall, cons_tokens, cons_wall, both_tokens, both_wall,
                           trainer_wait, target_idle, steady_tok_s, steady_chunks,
                           float(steady is None), steady_idle], dtype=torch.float64)
    group = ctx.trainer_group if len(cfg.split.trainer_ranks) > 1 else None
    if group is not None:  # on the rank's device: an NCCL group takes no CPU tensor
        sums = values.to(ctx.device, copy=True)
        dist.all_reduce(sums, group=group)
        maxes = values.to(ctx.device, copy=True)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        merged = merge_rank_values(sums.cpu().tolist(), maxes.cpu().tolist())
    else:
        merged = values.tolist()
    if ctx.rank != cfg.split.trainer_ranks[0]:
        return
    result = bench_result(steps, merged, topology=ctx.topology)
    out = os.environ.get(RESULT_ENV)
    if out:
        write_atomic(Path(out), json.dumps(result))


# The values each trainer rank contributes to the result, in order, and how they combine over
# the trainer ranks: token counts and rates add up; walls, the idle shares and "no steady
# window" are the worst rank's. The trainers step in lockstep (each step's gradients are
# reduced over all of them), so while one waits for a sample the others wait in that reduction,
# which their own receive-wait does not count: the group is idle at least as long as its most
# starved rank, and a mean would halve that for two trainers of which one starves.
RANK_VALUES = (
    ("prod_tokens", "sum"), ("prod_wall", "max"), ("cons_tokens", "sum"), ("cons_wall", "max"),
    ("both_tokens", "sum"), ("both_wall", "max"), ("trainer_wait", "max"), ("target_idle", "max"),
    ("steady_tok_s", "sum"), ("steady_chunks", "sum"), ("no_steady", "max"), ("steady_idle", "max"),
)


def merge_rank_values(sums: Sequence[float], maxes: Sequence[float]) -> list[float]:
    """The trainer ranks' :data:`RANK_VALUES` combined, from their elementwise sums and maxima."""
    pick = {"sum": lambda i: sums[i], "max": lambda i: maxes[i]}
    return [pick[how](i) for i, (_, how) in enumerate(RANK_VALUES)]


def paced_producer_rate(summed_tok_s: float, topology) -> float:
    """What the trainers of ``topology`` can take of phase 1's ``summed_tok_s`` (all producers'
    tokens over the slowest one's wall). Each producer computed tokens for its own trainers, so
    where one feeds more trainers than another it took longer and the sum already runs at its
    pace; where some trainer has fewer producers than another, the others' surplus is never
    taken (:func:`feed_rate` of the mean producer's rate)."""
    loads = [len(topology.dests(p)) for p in topology.producers]
    capacity = summed_tok_s * max(loads) / sum(loads)  # the most loaded producer's rate
    return feed_rate(len(topology.producers), len(topology.trainers), capacity)


def bench_result(steps: int, values: Sequence[float], topology=None) -> dict:
    """The result of the three phases from the (merged) :data:`RANK_VALUES`: the rates, the
    idle shares and end-to-end / min(producer, consumer). With the job's ``topology``, the
    producers' rate is what its trainers can take (:func:`paced_producer_rate`), and
    ``producer_summed_tok_s`` the sum where that is less."""
    (p_tok, p_wall, c_tok, c_wall, e_tok, e_wall, wait, target_idle, s_rate, s_chunks,
     no_steady, s_idle) = values
    summed = p_tok / max(p_wall, 1e-9)
    paced = summed if topology is None else paced_producer_rate(summed, topology)
    result = {
        "steps": steps,
        "producer_tok_s": paced,
        "consumer_tok_s": c_tok / max(c_wall, 1e-9),
        "from_empty_tok_s": e_tok / max(e_wall, 1e-9),
        "steady_tok_s": None if no_steady else s_rate,
        "steady_chunks": int(s_chunks),
        "from_empty_trainer_idle": wait / max(e_wall, 1e-9),
        "steady_trainer_idle": None if no_steady else s_idle,
        "target_idle": target_idle,
    }
    if paced < summed * (1 - 1e-9):
        result["producer_summed_tok_s"] = summed
    slower = max(1e-9, min(result["producer_tok_s"], result["consumer_tok_s"]))
    result["from_empty_efficiency"] = result["from_empty_tok_s"] / slower
    result["end_to_end_tok_s"] = result["steady_tok_s"] or result["from_empty_tok_s"]
    result["split_efficiency"] = result["end_to_end_tok_s"] / slower
    result["trainer_idle"] = (result["from_empty_trainer_idle"] if no_steady
                              else result["steady_trainer_idle"])
    return result


# --------------------------------------------------------------------------- command


def report(result: dict) -> str:
    """The human-readable lines and the final machine-readable one."""
    faster = "producer" if result["producer_tok_s"] >= result["consumer_tok_s"] else "consumer"
    uneven = ""
    if result.get("producer_summed_tok_s"):
        uneven = (f" (what the trainers, in lockstep, can take of the target ranks' "
                  f"{result['producer_summed_tok_s']:.1f}: they feed the trainers unevenly)")
    lines = [
        f"producer alone            : {result['producer_tok_s']:8.1f} tok/s{uneven}",
        f"consumer alone            : {result['consumer_tok_s']:8.1f} tok/s (from memory)",
    ]
    if result["steady_tok_s"]:
        lines.append(f"both together, steady     : {result['steady_tok_s']:8.1f} tok/s "
                     f"({result['steady_chunks']} whole chunks, chunk end to chunk end; trainer "
                     f"idle {result['steady_trainer_idle']:.3f})")
    lines += [
        f"both together, from empty : {result['from_empty_tok_s']:8.1f} tok/s ({result['steps'] + 1} "
        f"steps, the pipeline's fill included: {result['from_empty_efficiency']:.3f} of the slower "
        f"side; trainer idle {result['from_empty_trainer_idle']:.3f})",
        f"faster side               : {faster}",
        f"end-to-end / min(producer, consumer) = {result['split_efficiency']:.3f} "
        + ("(steady)" if result["steady_tok_s"] else "(from empty: no steady window, raise --steps)"),
        f"split_efficiency={result['split_efficiency']:.3f} "
        f"trainer_idle={result['trainer_idle']:.3f} target_idle={result['target_idle']:.3f}",
    ]
    return "\n".join(lines)


OWN_KEYS = ("train.output_dir=", "train.resume=")  # the benchmark's own: a scratch run folder


def _check_answers(cfg, overrides: Sequence[str]) -> None:
    """Say what the scratch run folder changes about the recipe as given (``cfg``): the
    overrides of its own keys go unused, and ``<train.output_dir>/regenerated.jsonl``, which
    ``draftforge train`` would read, is not read; refuse a bigram start without answers."""
    from draftforge.data.loading import regenerated_path
    from draftforge.errors import InputError

    unused = [o for o in overrides if o.startswith(OWN_KEYS)]
    if unused:
        print(f"draftforge bench split: {', '.join(unused)}: not used, the benchmark trains in a "
              "scratch run folder", file=sys.stderr, flush=True)
    if not cfg.data.regenerate or cfg.data.regenerated_file is not None:
        return
    answers = regenerated_path(cfg.data, cfg.train.output_dir)
    if cfg.train.markov_init == "bigram":
        raise InputError(
            "train.markov_init: bigram counts the training answers before the first step, and the "
            "benchmark's scratch run folder holds none: pass data.regenerated_file="
            f"{answers if answers.is_file() else 'PATH'} (written by 'draftforge data regenerate "
            "RECIPE'), or train.markov_init=random")
    if answers.is_file():
        print(f"draftforge bench split: the target answers the prompts during the benchmark (its run "
              f"folder is a scratch one), where 'draftforge train' would read {answers}; add "
              f"data.regenerated_file={answers} to measure that", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``draftforge bench split RECIPE [key=value ...] [--steps N]``."""
    parser = argparse.ArgumentParser(
        prog="draftforge bench split",
        description="Producer alone, consumer alone (fed from memory) and both together in one "
        "job of the recipe's split; prints end-to-end / min(producer, consumer).",
    )
    parser.add_argument("recipe", metavar="RECIPE", help="path to a recipe YAML file")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="e.g. split.max_in_flight=8")
    parser.add_argument("--steps", type=int, default=40,
                        help="timed optimizer steps per phase (default 40). A steady rate needs "
                        f"{MIN_STEADY_CHUNKS} whole chunks a link in phase 3: the CPU recipe's "
                        "chunks of 64 samples need about 130 steps (13 minutes on a 2-core EPYC "
                        "with native bf16, the answers regenerated ahead); with fewer the ratio "
                        "uses the from-empty rate, which counts the pipeline's fill")
    args = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    if args.steps <= 0:
        parser.error("--steps must be positive")

    from draftforge.config import load_recipe
    from draftforge.splitserve.launch import launch_env
    from draftforge.splitserve.multinode import rank_command, shown
    from draftforge.splitserve.roles import check_split
    from draftforge.splitserve.supervisor import run_ranks, term_seconds

    _check_answers(load_recipe(args.recipe, args.overrides,
                               reread="the benchmark's ranks read it again"), args.overrides)
    with tempfile.TemporaryDirectory(prefix="draftforge-bench-split-") as tmp:
        overrides = [*(o for o in args.overrides if not o.startswith(OWN_KEYS)),
                     f"train.output_dir={tmp}/run", "train.resume=never"]
        cfg = load_recipe(args.recipe, overrides)
        check_split(cfg)
        out = Path(tmp) / "result.json"
        command = rank_command(args.recipe, overrides)
        command += ["--bench-split", json.dumps({"steps": args.steps})]
        env = dict(launch_env(), **{RESULT_ENV: str(out)})
        print(f"draftforge bench split: {cfg.split.world_size} ranks of {shown(command)}",
              file=sys.stderr, flush=True)
        status = run_ranks(command, nproc=cfg.split.world_size, env=env, prefix="draftforge bench split",
                           term_s=term_seconds(cfg.target.backend))
        if status != 0 or not out.is_file():
            print(f"draftforge bench split: the job failed (exit status {status})", file=sys.stderr)
            return status or 1
        result = json.loads(out.read_text())
    sys.stdout.write(report(result) + "\n")
    return 0
