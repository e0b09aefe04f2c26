"""The contract between target and trainer: a :class:`Sample`, token-budget packing and collation.

A sample is everything the draft needs from one sequence, as tensors: token
ids, loss mask, the target's auxiliary features and its final post-norm hidden
state. Batches are right-padded; padded positions never carry loss.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch


@dataclass
class Sample:
    """One sequence as the target produced it.

    input_ids [S] int64, loss_mask [S] bool, aux [S, K*H_t] (bf16 on the wire),
    final [S, H_t] (the target's final post-norm hidden state).
    """

    sample_id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor
    provenance: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("input_ids", "loss_mask"):  # a [S, 1] mask would fail in collate, unnamed
            tensor = getattr(self, name)
            if tensor.dim() != 1:
                raise ValueError(f"sample {self.sample_id!r}: {name} must be 1-D, got {tuple(tensor.shape)}")
        length = self.input_ids.shape[0]
        for name in ("loss_mask", "aux", "final"):
            tensor = getattr(self, name)
            if tensor.shape[0] != length:
                raise ValueError(
                    f"sample {self.sample_id!r}: {name} has {tensor.shape[0]} positions, "
                    f"input_ids has {length}"
                )
        if self.aux.dim() != 2 or self.final.dim() != 2:
            raise ValueError(
                f"sample {self.sample_id!r}: aux and final must be [S, features], got "
                f"{tuple(self.aux.shape)} and {tuple(self.final.shape)}"
            )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class Batch:
    """Right-padded tensors of several samples: [B, S_max] ids/mask, [B, S_max, F] features."""

    sample_ids: list[str]
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor
    lengths: list[int]

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens."""
        return sum(self.lengths)

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.sample_ids,
            self.input_ids.to(device, non_blocking=True),
            self.loss_mask.to(device, non_blocking=True),
            self.aux.to(device, non_blocking=True),
            self.final.to(device, non_blocking=True),
            self.lengths,
        )


def padded_tokens(samples: Iterable[Sample]) -> int:
    """Tokens a batch of ``samples`` occupies once right-padded: B * S_max."""
    samples = list(samples)
    return len(samples) * max((s.num_tokens for s in samples), default=0)


def pack(samples: list[Sample], token_budget: int) -> list[list[Sample]]:
    """Greedy packing, in order, into batches whose padded size B * S_max stays within the budget.

    A sample longer than the budget gets a batch of its own. The order is kept,
    so dropping a prefix of whole batches leaves the remaining batches unchanged
    (what exact resume relies on).
    """
    if token_budget <= 0:
        raise ValueError(f"token_budget must be positive, got {token_budget}")
    batches: list[list[Sample]] = []
    current: list[Sample] = []
    longest = 0
    for sample in samples:
        grown = max(longest, sample.num_tokens) * (len(current) + 1)
        if current and grown > token_budget:
            batches.append(current)
            current, longest = [], 0
        current.append(sample)
        longest = max(longest, sample.num_tokens)
    if current:
        batches.append(current)
    return batches


def collate(samples: list[Sample]) -> Batch:
    """Right-pad ``samples`` into one :class:`Batch`; padded positions have loss_mask False.

    Features keep the samples' dtype (bf16 on the wire); the model casts them. The
    batch is built where the samples are: samples received over NCCL are already on
    the trainer's GPU and must not make a round trip through host memory.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    lengths = [s.num_tokens for s in samples]
    max_len = max(lengths)
    batch = len(samples)
    first = samples[0]
    device = first.aux.device
    input_ids = torch.zeros(batch, max_len, dtype=torch.long, device=device)
    loss_mask = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
    aux = torch.zeros(batch, max_len, first.aux.shape[1], dtype=first.aux.dtype, device=device)
    final = torch.zeros(batch, max_len, first.final.shape[1], dtype=first.final.dtype, device=device)
    for row, sample in enumerate(samples):
        if sample.aux.shape[1] != aux.shape[2] or sample.final.shape[1] != final.shape[2]:
            raise ValueError(
                f"sample {sample.sample_id!r} has feature widths {sample.aux.shape[1]}/{sample.final.shape[1]}, "
                f"the batch has {aux.shape[2]}/{final.shape[2]}"
            )
        n = lengths[row]
        input_ids[row, :n] = sample.input_ids
        loss_mask[row, :n] = sample.loss_mask.bool()
        aux[row, :n] = sample.aux
        final[row, :n] = sample.final
    return Batch([s.sample_id for s in samples], input_ids, loss_mask, aux, final, lengths)
