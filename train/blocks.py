"""Anchors, packed blocks and their attention masks.

For a sequence of length S and A anchors ``p_a`` the packed forward runs all
A * γ block tokens at once. Keys are ``[context 0..S-1 ; block tokens]``; the
query at slot k of block a sees context j iff ``j < p_a`` and block keys of
block a only (bidirectional inside the block). Slot k predicts ``p_a + k + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BlockLayout:
    """Where the blocks of a batch sit.

    anchors [B, A] (dummy anchors are 0), anchor_valid [B, A], and the derived
    per-slot tensors, all [B, A, γ]: ``positions`` = p + k, ``labels`` = token at
    p + k + 1, ``prev_tokens`` = token at p + k (the Markov head's input),
    ``valid`` = cumulative label validity.
    """

    anchors: torch.Tensor
    anchor_valid: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    prev_tokens: torch.Tensor
    valid: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.positions.shape[-1]

    @property
    def num_anchors(self) -> int:
        return self.anchors.shape[1]


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors per sequence: positions p with loss_mask[p] and loss_mask[p + 1].

    Returns (anchors [B, A] sorted, valid [B, A]) with A = ``num_anchors`` or, when no
    sequence has that many candidates, the most any sequence has (at least 1): a batch of
    short samples runs no block that only pads. Sequences with fewer than A candidates
    are padded with dummy anchors (position 0, valid False).
    """
    batch, seq_len = loss_mask.shape
    mask = loss_mask.bool()
    candidates = torch.zeros_like(mask)
    candidates[:, :-1] = mask[:, :-1] & mask[:, 1:]
    width = max(1, min(num_anchors, int(candidates.sum(dim=1).max())))
    anchors = torch.zeros(batch, width, dtype=torch.long)
    valid = torch.zeros(batch, width, dtype=torch.bool)
    for b in range(batch):
        positions = candidates[b].nonzero().flatten().cpu()
        if positions.numel() > width:
            chosen = torch.randperm(positions.numel(), generator=generator)[:width]
            positions = positions[chosen].sort().values
        anchors[b, : positions.numel()] = positions
        valid[b, : positions.numel()] = True
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


def build_layout(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    block_size: int,
) -> BlockLayout:
    """Per-slot positions, labels, previous tokens and cumulative validity."""
    seq_len = input_ids.shape[1]
    offsets = torch.arange(block_size, device=anchors.device)
    positions = anchors.unsqueeze(-1) + offsets  # p + k
    label_pos = positions + 1
    in_range = label_pos < seq_len
    label_pos_c = label_pos.clamp(max=seq_len - 1)
    positions_c = positions.clamp(max=seq_len - 1)
    batch_idx = torch.arange(input_ids.shape[0], device=anchors.device)[:, None, None]
    labels = input_ids[batch_idx, label_pos_c]
    prev_tokens = input_ids[batch_idx, positions_c]
    supervised = loss_mask.bool()[batch_idx, label_pos_c] & in_range & anchor_valid.unsqueeze(-1)
    valid = supervised.long().cumprod(dim=-1).bool()
    return BlockLayout(anchors, anchor_valid, positions, labels, prev_tokens, valid)


def block_input_ids(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """[x_p, MASK, ..., MASK] per block, flattened to [B, A * γ]."""
    batch, num_anchors = anchors.shape
    ids = torch.full((batch, num_anchors, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, :, 0] = input_ids.gather(1, anchors)
    return ids.view(batch, num_anchors * block_size)


def dense_block_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Boolean mask [B, A*γ, S + A*γ], True where the query may attend."""
    batch, num_anchors = anchors.shape
    device = anchors.device
    num_queries = num_anchors * block_size
    query_block = torch.arange(num_queries, device=device) // block_size  # [Q]
    query_anchor = anchors[:, query_block]  # [B, Q]
    ctx_visible = torch.arange(seq_len, device=device)[None, None, :] < query_anchor[:, :, None]
    same_block = query_block[:, None] == query_block[None, :]
    block_visible = same_block.unsqueeze(0).expand(batch, -1, -1)
    return torch.cat([ctx_visible, block_visible], dim=-1)


def flex_block_mask(anchors: torch.Tensor, seq_len: int, block_size: int):
    """The same visibility as :func:`dense_block_mask`, as a flex_attention BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, num_anchors = anchors.shape
    num_queries = num_anchors * block_size

    def mask_mod(b, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        ctx_ok = (kv_idx < seq_len) & (kv_idx < anchors[b, q_block])
        block_ok = (kv_idx >= seq_len) & ((kv_idx - seq_len) // block_size == q_block)
        return ctx_ok | block_ok

    return create_block_mask(
        mask_mod, B=batch, H=None, Q_LEN=num_queries, KV_LEN=seq_len + num_queries,
        device=anchors.device,
    )
