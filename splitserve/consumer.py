"""Trainer ranks: samples off the wire -> :class:`~draftforge.train.sample.Sample` -> packed batches.

The stream returns a credit to the producer for every sample it takes (and a
heartbeat until it stops, see :class:`~draftforge.splitserve.transport.AckLink`),
records the wait and the queue depth, and packs samples in order (the same rule
as :func:`draftforge.train.sample.pack`), so the batches depend only on the order
of samples, which the producers fix (see :mod:`draftforge.splitserve.producer`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator

from draftforge.splitserve import transport as T
from draftforge.splitserve.accounting import ConsumerAccounting
from draftforge.train.sample import Sample


class ConsumerStream:
    """The samples a trainer rank receives, in its fixed order; credits flow back as it takes them.

    ``acks``: the trainer's :class:`~draftforge.splitserve.transport.AckLink`, which has
    sent the resume state; without it the stream starts one (every ``heartbeat_s``) to
    producers that already have it. ``log``: where :meth:`stop` says that a producer was lost
    (the rank's log; default: stderr).
    """

    def __init__(
        self,
        receiver: T.SampleReceiver,
        *,
        ack_group,
        accounting: ConsumerAccounting | None = None,
        provenance: dict | None = None,
        heartbeat_s: float = 60.0,
        acks: T.AckLink | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.receiver = receiver
        self.ack_group = ack_group
        if acks is None:
            acks = T.AckLink(receiver.sources, group=ack_group, every_s=heartbeat_s)
        self.acks = acks
        self.accounting = accounting
        self.provenance = dict(provenance or {})
        self.taken = dict.fromkeys(receiver.sources, 0)
        self.max_depth = 0
        self.heartbeat_s = heartbeat_s
        self._stopped = False
        self.warning: str | None = None  # a producer lost after the last step (see stop)
        self._log = log or (lambda text: print(text, file=sys.stderr, flush=True))

    def samples(self) -> Iterator[Sample]:
        """Yield samples until every producer has ended its stream."""
        while True:
            begin = time.perf_counter()
            depth = self.receiver.depth()
            self.acks.check()
            # the heartbeat runs meanwhile (and while the trainer works); what it meets is raised
            # while waiting too, not only at the next sample
            item = self.receiver.get(check=self.acks.check)
            waited = time.perf_counter() - begin
            if item is None:
                return
            src, wire = item
            depth = max(depth, 1)  # the queue held at least the sample just taken
            self.max_depth = max(self.max_depth, depth)
            self.taken[src] += 1
            self.acks.ack(src, self.taken[src])
            sample = Sample(
                sample_id=wire.sample_id,
                input_ids=wire.input_ids,
                loss_mask=wire.loss_mask,
                aux=wire.aux,
                final=wire.final,
                provenance={**self.provenance, "target_rank": src, "chunk_end": wire.chunk_end,
                            "dropped_ids": wire.dropped_ids},
            )
            if self.accounting is not None:
                self.accounting.on_take(depth, sample.num_tokens, waited, sample.sample_id)
                self.accounting.on_producer_stats(src, wire.producer_stats)
            yield sample

    def stop(self, timeout_s: float = 600.0) -> int:
        """End the heartbeat, tell every producer to stop, then drop what is still in
        transit until each ends its stream (a producer still busy with a chunk sends
        heartbeats meanwhile; one silent for ``timeout_s`` is given up on).

        Returns the number of samples dropped (they were never consumed, so a
        later run gets them again). The trainer has taken all it needs by now: a producer
        that died meanwhile ends the drain with a warning (kept in :attr:`warning`, said
        through ``log``), not an error that would fail a finished run; the other producers
        are still received to their end, so that none is left waiting in a send to this
        trainer (it would report the trainer dead once it exits). Malformed data from a
        producer (a :class:`~draftforge.splitserve.transport.WireError`, a dying producer's
        garbage) ends that producer's drain with a warning too, and the others are drained
        as after a death.
        """
        if self._stopped:
            return 0
        self._stopped = True
        dropped, lost, others = 0, None, []
        try:
            self.acks.stop()
        except T.PeerDied as exc:  # the others were told: drain them
            lost = exc
        try:
            while True:
                item = self.receiver.get(max_wait_s=1.0)
                if item is None:
                    break
                if item is T.SampleReceiver.IDLE:
                    if time.monotonic() - self.receiver.heard > timeout_s:
                        break
                    continue
                dropped += 1
        except (T.PeerDied, T.WireError) as exc:  # after the last step: nothing of it is trained on
            drained = []
            if exc is self.receiver.error:  # the other producers' last messages still find a receive
                more, drained = self.receiver.drain_rest()
                dropped += more
            for problem in [exc, *drained]:  # one line per producer: another one on its own
                if lost is None:
                    lost = problem
                elif problem.rank not in {lost.rank, *(o.rank for o in others)}:
                    others.append(problem)
        if lost is not None:
            self.warning = (f"warning: after this trainer's last step, {lost}; its steps are "
                            "done, the stream's end not waited for")
            self._log(self.warning)
            for exc in others:
                self._log(f"warning: after this trainer's last step, {exc}; that stream's end not "
                          "waited for either")
        self.receiver.join(timeout=5.0)
        return dropped


def stream_pack(samples: Iterable[Sample], token_budget: int) -> Iterator[list[Sample]]:
    """Greedy in-order packing of a stream, batch by batch: ``B * S_max <= token_budget``.

    Yields exactly the batches :func:`draftforge.train.sample.pack` makes of the
    same samples, without waiting for the end of the stream (a batch is yielded
    as soon as the next sample would not fit, or at the end).
    """
    if token_budget <= 0:
        raise ValueError(f"token_budget must be positive, got {token_budget}")
    current: list[Sample] = []
    longest = 0
    for sample in samples:
        grown = max(longest, sample.num_tokens) * (len(current) + 1)
        if current and grown > token_budget:
            yield current
            current, longest = [], 0
        current.append(sample)
        longest = max(longest, sample.num_tokens)
    if current:
        yield current
