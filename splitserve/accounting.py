"""Where the time goes: busy and idle shares of each group, rates, queue depth, a split advice.

Definitions (the same everywhere, printed at every log interval and in the summary):

- producer (a target rank): *busy* is time inside generate, tokenise, features and
  send; *idle* is time blocked waiting for a trainer's credit (the trainer is the
  slow side, or the credits hold less than a step: see ``credit_advice``) or for a
  trainer to take a sample's header (its "turn" among the producers feeding it).
  Its *rate* is tokens produced per wall second; its *capacity* is tokens per busy
  second (what it could do if never held back).
- consumer (a trainer rank): *busy* is the trainer's own ``compute_s`` per step
  (forward, backward, optimizer), *idle* its ``wait_s`` (blocked on the next
  batch, i.e. on the producers), both over the wall time from its start to the end of
  its last step (the final checkpoint and the stream's drain are neither). Its tokens
  and samples are those its steps trained (not the next batch's first sample, which
  the packer takes to close a batch, nor what is left when the data ends). Capacity:
  tokens per busy second. These are one trainer rank's (the first's, in the printed block and
  ``accounting.jsonl``); with several trainer ranks, the printed lines add every rank's tokens
  (a step's, as the training summary counts them) and their rate, in the end block over the
  training loop's time as the summary's tokens/s (:meth:`ConsumerAccounting.trainers`).
- queue depth: samples received by a trainer and not yet taken, the one being taken
  included (so at least 1), sampled at each take; its mean is over the takes, not
  weighted by time; never above the credits (``split.max_in_flight``).

The recommended split puts ``T`` of the ``N`` ranks on the target so that
``min(feed_rate(T, N - T), (N - T) * consumer_capacity)`` is largest, where
``feed_rate`` is what the producers can feed (``T * producer_capacity`` when the
trainers divide evenly among them; see :func:`feed_rate` when they do not), with the
capacities after the run's first step (whose compute includes the warm-up) where that
step was not the last. Without a
capacity measured on both sides (no training step yet, no target report) there is none:
``"recommended": null`` in ``accounting.jsonl``, as the summary says.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from draftforge.files import naming

_SERIES_KEPT = 400  # queue-depth points kept for the summary (thinned by half when reached)


class Meter:
    """Busy / idle stopwatch of one process, by part."""

    def __init__(self) -> None:
        self.busy_by: dict[str, float] = defaultdict(float)
        self.idle_by: dict[str, float] = defaultdict(float)
        self.tokens = 0
        self._start: float | None = None
        self._end: float | None = None

    def start(self) -> None:
        self._start = time.perf_counter()
        self._end = None

    def stop(self) -> None:
        self._end = time.perf_counter()

    @property
    def wall_s(self) -> float:
        if self._start is None:
            return 0.0
        end = self._end if self._end is not None else time.perf_counter()
        return end - self._start

    @property
    def busy_s(self) -> float:
        return sum(self.busy_by.values())

    @property
    def idle_s(self) -> float:
        return sum(self.idle_by.values())

    @contextmanager
    def busy(self, part: str) -> Iterator[None]:
        """Time the block as busy work of ``part``."""
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.busy_by[part] += time.perf_counter() - begin

    @contextmanager
    def idle(self, part: str) -> Iterator[None]:
        """Time the block as waiting on a peer (``part`` says which wait)."""
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.idle_by[part] += time.perf_counter() - begin

    def add_tokens(self, count: int) -> None:
        self.tokens += int(count)

    def wire_stats(self) -> list[int]:
        """``[busy_us, idle_us, tokens, wall_us]`` for the sample header."""
        return [int(self.busy_s * 1e6), int(self.idle_s * 1e6), self.tokens, int(self.wall_s * 1e6)]

    def summary(self) -> dict:
        """Totals, shares of wall time, rate and capacity, and the busy time by part."""
        return side_summary(self.busy_s, self.idle_s, self.wall_s, self.tokens) | {
            "busy_by_part_s": {k: round(v, 3) for k, v in self.busy_by.items()},
        }


def side_summary(busy_s: float, idle_s: float, wall_s: float, tokens: float) -> dict:
    """One side's figures from its totals. No wall time (a trainer that took samples but
    ran no step) gives no rate: dividing by a stand-in for zero read 10^11 tok/s."""
    wall = max(wall_s, 1e-9)
    return {
        "busy_s": round(busy_s, 3),
        "idle_s": round(idle_s, 3),
        "wall_s": round(wall_s, 3),
        "busy_share": busy_s / wall,
        "idle_share": idle_s / wall,
        "tokens": int(tokens),
        "rate_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "capacity_tok_s": tokens / busy_s if busy_s > 0 else 0.0,
    }


def _other(side: dict, spec: str) -> str:
    """The share of a trainer's wall time that is neither a step's compute nor its wait for
    data (checkpoint saves and logging between steps), when it is 1 % or more."""
    if side.get("wall_s", 1.0) <= 0:  # no time measured (no step ran): no share to give
        return ""
    other = 1.0 - side["busy_share"] - side["idle_share"]
    return f" other {other:{spec}} (checkpoints, logging)" if other >= 0.01 else ""


def feed_rate(num_producers: int, num_trainers: int, producer_capacity: float) -> float:
    """Tokens/s that ``num_producers`` producers of ``producer_capacity`` each can feed
    ``num_trainers`` trainers, which step in lockstep on equal shares of the data
    (``producer.Topology``): the most loaded producer sets the pace. With at most as many
    producers as trainers, one feeds up to ``ceil(R / P)`` trainers; with more, a trainer is
    fed by as few as ``floor(P / R)`` producers. Either way ``P * producer_capacity`` when
    the one divides the other (2 targets feeding 3 trainers feed at 1.5 x, not 2 x, one's)."""
    if num_producers <= num_trainers:
        return producer_capacity * num_trainers / math.ceil(num_trainers / num_producers)
    return producer_capacity * num_trainers * (num_producers // num_trainers)


def recommend_split(
    world: int, producer_capacity: float, consumer_capacity: float, *, tensor_parallel: int = 1
) -> tuple[int, int, float]:
    """``(target_ranks, trainer_ranks, expected tokens/s)`` maximising the slower side.

    ``producer_capacity`` is one producer's: a tensor-parallel group of ``tensor_parallel``
    target ranks, so target groups come in multiples of it. The target side's rate is
    :func:`feed_rate`'s (producers that do not divide the trainers evenly feed less)."""
    if world < 2:
        raise ValueError("a split needs at least 2 ranks")
    if world <= tensor_parallel:  # no room for a trainer beside one target group
        raise ValueError(f"a split of {world} ranks has no trainer rank beside a target group of "
                         f"{tensor_parallel}")
    best = (tensor_parallel, world - tensor_parallel, 0.0)
    for num_t in range(tensor_parallel, world, tensor_parallel):
        num_r = world - num_t
        rate = min(feed_rate(num_t // tensor_parallel, num_r, producer_capacity),
                   num_r * consumer_capacity)
        if rate > best[2]:
            best = (num_t, world - num_t, rate)
    return best


class ConsumerAccounting:
    """Trainer-side accounting: its own busy/idle, its producers' (from the wire), the queue."""

    def __init__(self, *, world: int, num_target: int, credits: int, num_sources: int = 1,
                 path: Path | None = None, tensor_parallel: int = 1):
        """``credits``: the most samples the trainer's queue can hold, over all its links;
        ``num_sources``: the producers feeding it (producer figures are their mean);
        ``tensor_parallel``: target ranks per producer (its figures are the group's)."""
        self.world = world
        self.num_sources = num_sources
        self.num_target = num_target
        self.tensor_parallel = tensor_parallel
        self.credits = credits
        self.path = path
        self.started = time.perf_counter()
        self.tokens = 0
        self.samples = 0
        self.wait_s = 0.0  # blocked on the receiver (the producers)
        self.compute_s = 0.0  # the trainer's own compute, from its step records
        self.step_wait_s = 0.0  # the trainer's wait_s, from its step records
        self.steps = 0
        self.trainer_ranks = world - num_target
        self.all_tokens = 0  # every trainer rank's, from the step records (the steps' tokens)
        # when the training loop started, as the first step's record dates it (its end less its wait
        # and compute): the clock of the training summary's tokens/s, which starts after this one
        self.loop_started: float | None = None
        self.stepped = self.started  # when the last step ended: the trainer's figures run to it
        # the queue's depth at each take, kept as running counts per depth (so a window's mean and
        # maximum come from two readings, not a list as long as the run) and as a thinned series
        # for the summary's plot; both bounded, whatever the number of samples
        self.takes = 0
        self._depth_counts: list[int] = []  # takes at depth d: _depth_counts[d]
        self._series: list[tuple[float, int]] = []  # (seconds, depth) of every _stride-th take
        self._stride = 1
        self.producers: dict[int, dict] = {}
        self._untrained: dict[str, int] = {}  # taken, not yet in a step: sample id -> tokens
        self._last: dict | None = None
        self._last_window: dict | None = None
        self._first_step: dict | None = None  # the totals at this run's first step's end

    # -- feeding
    def on_take(self, depth: int, tokens: int, waited_s: float, sample_id: str | None = None) -> None:
        """A sample was taken off the queue, which held ``depth`` samples at the take (this
        one included, as :class:`~draftforge.splitserve.consumer.ConsumerStream` counts them:
        at least 1). With its ``sample_id``
        its tokens count once a step trains it (:meth:`on_step`), else at once."""
        if depth >= len(self._depth_counts):
            self._depth_counts.extend([0] * (depth + 1 - len(self._depth_counts)))
        self._depth_counts[depth] += 1
        if self.takes % self._stride == 0:
            self._series.append((time.perf_counter() - self.started, depth))
            if len(self._series) >= _SERIES_KEPT:  # every other one: the stride doubles
                self._series = self._series[::2]
                self._stride *= 2
        self.takes += 1
        self.wait_s += waited_s
        if sample_id is not None:
            self._untrained[sample_id] = tokens
            return
        self.tokens += tokens
        self.samples += 1

    def on_producer_stats(self, src: int, stats: dict) -> None:
        self.producers[src] = dict(stats)

    def on_step(self, record: dict) -> None:
        """A step ended: its time, and the samples of this rank it trained (its
        ``sample_ids`` are every trainer rank's)."""
        for sample_id in record.get("sample_ids", ()):
            tokens = self._untrained.pop(sample_id, None)
            if tokens is not None:
                self.tokens += tokens
                self.samples += 1
        self.all_tokens += int(record.get("tokens", 0) or 0)  # summed over the trainer group
        self.compute_s += float(record.get("compute_s", 0.0))
        self.step_wait_s += float(record.get("wait_s", 0.0))
        self.steps += 1
        self.stepped = time.perf_counter()
        if self.steps == 1:
            self.loop_started = self.stepped - float(record.get("wait_s", 0.0)) - float(record.get("compute_s", 0.0))
            self._first_step = self._totals()

    # -- reading
    def producer_idle_wall(self) -> tuple[float, float]:
        """The producers' running (idle seconds, wall seconds), averaged per rank, as last
        reported on the wire: two readings give the idle share between them."""
        totals = self._totals()
        return totals["p_idle_s"], totals["p_wall_s"]

    def _totals(self) -> dict:
        """Running sums of both sides (producers averaged per rank) and the depth samples so far.

        The mean is over every source from the start, one not heard from yet counting as
        zero: dividing by the sources seen so far would shrink the running mean when a
        new one first reports, and an interval's difference could turn negative."""
        prod = {"busy_s": 0.0, "idle_s": 0.0, "wall_s": 0.0, "tokens": 0.0}
        for stats in self.producers.values():
            for key in prod:
                prod[key] += stats.get(key, 0.0)
        count = max(self.num_sources, len(self.producers))
        return {
            # to the last step's end, not now: what follows it would dilute both shares and the rate
            "wall": self.stepped - self.started,
            "compute": self.compute_s,
            "wait": self.step_wait_s,
            "wire_wait": self.wait_s,
            "tokens": self.tokens,
            "all_tokens": self.all_tokens,
            "samples": self.samples,
            "depth_counts": tuple(self._depth_counts),
            **{f"p_{key}": value / count for key, value in prod.items()},
        }

    def snapshot(self, since: dict | None = None) -> dict:
        """Both sides and the queue, over the whole run or since the totals ``since``."""
        now = self._totals()
        base = since or {}
        d = {key: value - base.get(key, 0) for key, value in now.items() if key != "depth_counts"}
        consumer = side_summary(d["compute"], d["wait"], d["wall"], d["tokens"])
        consumer["wire_wait_s"] = round(d["wire_wait"], 3)
        producer = side_summary(d["p_busy_s"], d["p_idle_s"], d["p_wall_s"], d["p_tokens"])
        before = base.get("depth_counts", ())
        counts = [n - (before[depth] if depth < len(before) else 0)
                  for depth, n in enumerate(now["depth_counts"])]
        takes = sum(counts)
        queue = {
            "mean": sum(depth * n for depth, n in enumerate(counts)) / takes if takes else 0.0,
            "max": max((depth for depth, n in enumerate(counts) if n), default=0),
            "credits": self.credits,
        }
        recommended = None  # a side with no capacity measured: no advice (see _verdict)
        if producer["capacity_tok_s"] > 0 and consumer["capacity_tok_s"] > 0:
            capacities = ((producer["capacity_tok_s"], consumer["capacity_tok_s"]) if since
                          else self._capacities(producer, consumer))
            num_t, num_r, expected = recommend_split(
                self.world, *capacities, tensor_parallel=self.tensor_parallel,
            )
            recommended = {"target_ranks": num_t, "trainer_ranks": num_r,
                           "expected_tok_s": expected}  # the whole job's, at the slower side
        return {
            "time_s": round(now["wall"], 3),
            "samples": int(d["samples"]),
            "producer": producer,
            "consumer": consumer,
            "queue": queue,
            "recommended": recommended,
        }

    def trainers(self, since: dict | None = None, *, loop: bool = True) -> dict:
        """Every trainer rank's tokens (the step records', which the training summary counts) and
        their rate: for the whole run over the training loop's time to the end of its last step
        (the training summary's ``elapsed_s``, give or take the bookkeeping of a step, so that the
        two tokens/s agree); since the totals ``since``, or with ``loop`` false, over this rank's
        time, as its own figures (the ranks step together). :meth:`snapshot`'s ``consumer`` is
        this rank's alone."""
        now, base = self._totals(), since or {}
        tokens = now["all_tokens"] - base.get("all_tokens", 0)
        if loop and since is None and self.loop_started is not None:
            wall = self.stepped - self.loop_started
        else:
            wall = now["wall"] - base.get("wall", 0)
        return {"ranks": self.trainer_ranks, "tokens": int(tokens),
                "rate_tok_s": tokens / wall if wall > 0 else 0.0, "wall_s": wall}

    def line(self) -> str:
        """One log line: the figures since the previous line (the interval)."""
        every = self.trainers(since=self._last, loop=False)  # over the interval, as this rank's
        s = self.snapshot(since=self._last)
        self._last = self._totals()
        self._last_window = s
        p, c, q = s["producer"], s["consumer"], s["queue"]
        # no sample header arrived in the interval (a long generation chunk): no report, not zeros;
        # headers that span a sliver of it (samples of one chunk, computed before the interval and
        # sent in it) describe that sliver, not the interval: said so, not given as its shares
        if p["wall_s"] <= 0:
            target = "target: no report this interval (no sample arrived)"
        elif p["wall_s"] < 0.5 * c["wall_s"]:
            target = (f"target: its reports span {p['wall_s']:.1f} s of this interval's {c['wall_s']:.1f} s "
                      "(samples computed before it), no figures")
        else:
            target = (f"target busy {p['busy_share']:.0%} idle {p['idle_share']:.0%} "
                      f"{p['rate_tok_s']:.0f} tok/s (capacity {p['capacity_tok_s']:.0f})")
        # one trainer rank's figures; with several, said so, and all of theirs beside them
        several = self.trainer_ranks > 1
        return (
            f"split (last interval): {target} | "
            f"trainer{f' (this rank of {self.trainer_ranks})' if several else ''} "
            f"busy {c['busy_share']:.0%} idle {c['idle_share']:.0%}{_other(c, '.0%')} "
            f"{c['rate_tok_s']:.0f} tok/s (capacity {c['capacity_tok_s']:.0f})"
            + (f", all {self.trainer_ranks} {every['rate_tok_s']:.0f} tok/s" if several else "")
            + " | "
            f"queue {q['mean']:.1f} avg {q['max']} max of {q['credits']}"
        )

    def summary_text(self) -> str:
        """The end-of-run block, with the recommended split."""
        s = self.snapshot()
        p, c, q, rec = s["producer"], s["consumer"], s["queue"], s["recommended"]
        return "\n".join([
            "split accounting:",
            # the producers' figures as the header of the last sample taken carried them (at its
            # send): not their whole serving (roles' "done (serving, to the trainers' stop)"
            # line, on the target's rank), which adds the samples made after that one and the
            # wait for the trainers' stop, so the two lines' figures differ
            self._target_line(p, c),
            f"  trainer (this rank{f' of {self.trainer_ranks}' if self.trainer_ranks > 1 else ''}): "
            f"busy {c['busy_share']:.1%}  idle {c['idle_share']:.1%}{_other(c, '.1%')}  "
            f"{c['tokens']} tokens  {c['rate_tok_s']:.0f} tok/s  capacity {c['capacity_tok_s']:.0f} tok/s",
            *filter(None, [self._all_trainers(self.trainers())]),
            f"  queue depth: mean {q['mean']:.2f}, max {q['max']} (credits {q['credits']})",
            f"  {self._verdict(p, c, rec)}",
            *filter(None, [self.credit_advice(s)]),
        ])

    @staticmethod
    def _target_line(p: dict, c: dict) -> str:
        """The summary's target line; a rank no sample reached has no report, not zeros."""
        if p["wall_s"] <= 0:
            return "  target  (per producer): no report (no sample reached this trainer rank)"
        return (f"  target  (per producer, as of the last sample taken: {p['wall_s']:.0f} s, against the "
                f"trainer's {c['wall_s']:.0f} s): busy {p['busy_share']:.1%}  "
                f"idle {p['idle_share']:.1%}  "
                f"{p['tokens']} tokens  {p['rate_tok_s']:.0f} tok/s  capacity {p['capacity_tok_s']:.0f} tok/s")

    def _all_trainers(self, trainers: dict) -> str | None:
        """With several trainer ranks, the line of all of theirs: the training summary's tokens
        (every rank's) and tokens/s (over the training loop's time, which starts after this
        rank's: the run's records are written first)."""
        if self.trainer_ranks <= 1:
            return None
        return (f"  trainers (all {trainers['ranks']}, as the training summary counts them): {trainers['tokens']} "
                f"tokens  {trainers['rate_tok_s']:.0f} tok/s in the training loop's {trainers['wall_s']:.1f} s")

    def _capacities(self, p: dict, c: dict) -> tuple[float, float]:
        """The (producer, consumer) capacities that the whole run's split advice is judged on:
        those after this run's first step, whose compute includes the warm-up (a compile of the
        objective, the device's first kernels), which understated a short run's trainer
        capacity; the whole run's ``p`` and ``c`` where nothing was measured after it."""
        if self._first_step is not None:
            steady = self.snapshot(since=self._first_step)
            capacities = steady["producer"]["capacity_tok_s"], steady["consumer"]["capacity_tok_s"]
            if min(capacities) > 0:
                return capacities
        return p["capacity_tok_s"], c["capacity_tok_s"]

    def _verdict(self, p: dict, c: dict, rec: dict | None) -> str:
        """The slower side and the recommended split (judged after the first step, see
        :meth:`_capacities`), or that a side has no capacity measured (a trainer that ran no
        step, a target not heard from): advice from nothing misleads."""
        current = f"{self.num_target} target + {self.world - self.num_target} trainer"
        if c["capacity_tok_s"] <= 0 or p["capacity_tok_s"] <= 0:
            if self.steps == 0:
                missing = "no training step"
            elif c["capacity_tok_s"] <= 0:  # its steps were fillers: another rank held every sample
                missing = "this rank trained no sample of its own"
            else:
                missing = "no target report"
            return f"slower side: not measured ({missing}), no split recommended (now {current})"
        # the groups' capacities, not one rank's: 1 target at 100 tok/s feeds 3 trainers at 50 slower
        num_trainers = self.world - self.num_target
        producers = self.num_target // self.tensor_parallel
        producer_capacity, consumer_capacity = self._capacities(p, c)
        feed = feed_rate(producers, num_trainers, producer_capacity)
        slower = "target" if feed < num_trainers * consumer_capacity else "trainer"
        advice = f"{rec['target_ranks']} target + {rec['trainer_ranks']} trainer"
        basis = ""  # the capacities judged on, where they are not the ones printed above
        if (producer_capacity, consumer_capacity) != (p["capacity_tok_s"], c["capacity_tok_s"]):
            basis = (f"; judged after the first step (warm-up): capacity target "
                     f"{producer_capacity:.0f}, trainer {consumer_capacity:.0f} tok/s")
        return (f"slower side: {slower}; recommended split for {self.world} ranks: {advice} "
                f"(now {current}){basis}")

    def credit_advice(self, s: dict) -> str | None:
        """Both sides idle at once while a step packs more samples than the credits hold: the
        target stops after ``credits`` samples, the trainer then waits for the rest of its
        next step, and neither rate is the limit (no split advice helps; more credits do).

        Judged in the steady state, after this run's first step, whose wait is the pipeline's
        fill (the target's first chunk), not the credits: ``s`` (the whole run) only where
        no step and no producer report came after it. A step of exactly ``credits`` samples
        is enough: the trainer already holds the next batch's first sample (the packer took
        it to close the batch), so ``credits`` more close the next batch."""
        steady = self.snapshot(since=self._first_step) if self._first_step is not None else None
        if steady is not None and steady["consumer"]["wall_s"] > 0 and steady["producer"]["wall_s"] > 0:
            s, steps, samples = steady, self.steps - 1, steady["samples"]
        else:
            steps, samples = self.steps, self.samples
        p, c = s["producer"], s["consumer"]
        if not steps or p["idle_share"] <= 0.1 or c["idle_share"] <= 0.1:
            return None
        per_step = samples / steps
        if per_step <= self.credits:
            return None
        return (f"  both sides waited (target idle {p['idle_share']:.0%}, trainer idle "
                f"{c['idle_share']:.0%}): a step took {per_step:.1f} samples and the trainer's "
                f"credits hold {self.credits}, so the target cannot work a step ahead; raise "
                f"split.max_in_flight to about {2 * math.ceil(per_step)}")

    def depth_series(self, points: int = 200) -> list[list[float]]:
        """Queue depth over time, ``[[seconds, depth], ...]``, thinned to at most ``points``."""
        stride = max(1, -(-len(self._series) // points))
        return [[round(t, 3), d] for t, d in self._series[::stride]]

    def begin(self, step: int) -> None:
        """Open this run's segment of ``accounting.jsonl`` with a ``start`` record at ``step``.

        A resumed run appends after the interrupted one (whose figures are time that was
        really spent); a crash may have cut that run's last line, and the fragment is dropped
        first so that every line of the file parses.
        """
        if self.path is None:
            return
        if self.path.exists():
            drop_partial_line(self.path)
        self.write("start", step)

    def write(self, event: str, step: int | None = None) -> None:
        """Append the snapshot (and, in the summary, the queue depth over time) to ``accounting.jsonl``."""
        if self.path is None:
            return
        record = {"event": event, "step": step, **self.snapshot()}
        if event == "interval" and self._last_window is not None:
            record["window"] = self._last_window
        if event == "summary":
            record["queue_depth_over_time"] = self.depth_series()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with naming(self.path), open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def drop_partial_line(path: Path) -> None:
    """Cut ``path`` after its last newline: what follows it is a line a crash left unfinished."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        os.truncate(path, data.rfind(b"\n") + 1)
