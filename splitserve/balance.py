"""Which trainer each of a producer's samples goes to.

Trainers consume in lockstep: every optimizer step takes ``train.grad_accum``
micro-batches on every trainer rank, each packed greedily in arrival order to
``split.token_budget`` padded tokens (:func:`draftforge.splitserve.consumer.stream_pack`).
So what must be balanced is not the tokens sent to each trainer but the micro-batches
they make: a trainer sent one long sample packs it alone, another sent the same tokens in
short samples packs several a micro-batch. Balanced by tokens chunk by chunk, the
trainer with fewer micro-batches' worth ran dry first, the producer answered more
prompts to feed it, and the other trainer's samples piled up on the target's device,
growing with the run (a simulation at Ling-like lengths: about a million tokens per
trainer after 20,000 chunks). :class:`PackedBalance` replays every trainer's packer
on the lengths it is sent and gives each sample to the trainer whose packer is least
advanced, so their micro-batch counts never differ by more than about one, and what
waits for a trainer stays within a couple of micro-batches.

The state carries over the whole run, chunk after chunk and epoch after epoch; a resumed
producer rebuilds it from the lengths of the samples the trainers already consumed
(their checkpoints record them), so every sample goes where the uninterrupted run sent
it (a sample whose length a checkpoint does not record is left out of the state, by the
run resumed from it and every later resume alike: see :mod:`draftforge.splitserve.producer`).
Deterministic: the same lengths in the same order give the same trainers.
"""

from __future__ import annotations

from collections.abc import Sequence


class PackedBalance:
    """Assigns samples to ``num_dests`` trainers, replaying each trainer's greedy packer."""

    def __init__(self, num_dests: int, token_budget: int) -> None:
        if num_dests < 1:
            raise ValueError(f"num_dests must be at least 1, got {num_dests}")
        if token_budget < 1:
            raise ValueError(f"token_budget must be positive, got {token_budget}")
        self.token_budget = token_budget
        self.packed = [0] * num_dests  # micro-batches each trainer's packer has closed
        self.count = [0] * num_dests  # samples in its open micro-batch
        self.longest = [0] * num_dests  # the longest of them

    def progress(self, dest: int) -> int:
        """Padded tokens trainer ``dest`` has packed so far (closed micro-batches at the
        full budget: a closed micro-batch is one micro-step, however full)."""
        return self.packed[dest] * self.token_budget + self.count[dest] * self.longest[dest]

    def add(self, dest: int, length: int) -> None:
        """Pack a sample of ``length`` tokens on trainer ``dest``, as :func:`stream_pack` does."""
        if length < 1:
            raise ValueError(f"a sample has at least one token, got {length}")
        if self.count[dest] and max(self.longest[dest], length) * (self.count[dest] + 1) > self.token_budget:
            self.packed[dest] += 1
            self.count[dest], self.longest[dest] = 0, 0
        self.count[dest] += 1
        self.longest[dest] = max(self.longest[dest], length)

    def assign(self, lengths: Sequence[int], *, rotation: int = 0) -> list[int]:
        """The trainer index of each sample, in stream order: the one whose packer is least
        advanced; ties go to the first in the order rotated by ``rotation``."""
        n = len(self.packed)
        out = []
        for length in lengths:
            dest = min(range(n), key=lambda d: (self.progress(d), (d - rotation) % n))
            self.add(dest, length)
            out.append(dest)
        return out
