"""``train.markov_init: bigram``: start the Markov head as a bigram model of the training data.

The vanilla Markov head adds ``W2 @ W1[prev]`` to every slot's logits: a rank-r table
of next-token scores given the previous token. At the CPU recipe's budget the trained
draft predicts its first token no better than a count table of the same answers does
(RESULTS.md, "Where n-gram wins"), so this fills the table from the counts before the
first step instead of learning it from random weights:

- count the adjacent token pairs of the training samples' token ids, tokenised as the
  producer tokenises them, where both tokens are supervised (their loss mask is set): the
  pairs the draft's Markov head is trained on, each a slot's previous token and label, so
  the answers' pairs and not the prompts' or the chat template's (a system prompt repeated
  in every sample would otherwise outweigh the answers, and a template's "newline then
  turn marker" would be taught for newlines in answers);
- keep the :data:`MAX_TOKENS` most frequent previous tokens (seen at least twice) and
  next tokens;
- score ``log((c(a, b) + P(b)) / (c(a) + 1))``: the next-token probability with one
  pseudo-count spread as the unigram distribution, centred per row (softmax ignores a
  row constant);
- write its best rank-r approximation (randomised truncated SVD, seeded: its Frobenius error is
  within 0.2 % of the optimum's at the 8192 x 8192 cap and rank 256, per a review) into ``W1``
  and ``W2``; rows and columns of other tokens are zero, so those tokens get no
  correction: a next token outside the table sits at its row's mean score (the
  centring's zero), above the kept tokens that are rarer than average after that
  previous token. Over the kept columns the centring changes nothing (softmax ignores
  a row constant), but it makes the table's rank at most its number of next tokens less
  one. Where the table's rank is below the head's, ``W2``'s spare columns
  are zero and ``W1``'s keep the draft's seeded random init: the product is still the
  table, and those columns learn (zero in both factors, neither would ever get a
  gradient). A table that centres to all zeros (one distinct next token) has rank 0:
  ``W2`` is zero and all of ``W1`` keeps its init.
- a ``gated`` head multiplies ``W1[prev]`` by ``sigmoid(gate_proj([h; W1[prev]]))``:
  its ``gate_proj`` is zeroed, so the gate is exactly 1/2 whatever the hidden state,
  and ``W2`` is doubled, so the head starts as the same table with the gate still in
  the steep part of the sigmoid, free to learn.

Every rank computes the same weights from the same samples (and the same seeded init), so
FSDP2 shards agree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from draftforge.errors import InputError

MAX_TOKENS = 8192  # previous and next tokens kept: the dense table stays at most 8192^2
SVD_SEED = 0
OVERSAMPLE = 16  # extra directions of the randomised SVD, dropped after it


def bigram_scores(
    sequences: Iterable[Sequence[int]], *, masks: Iterable[Sequence[bool]] | None = None,
    max_tokens: int = MAX_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, cols, scores): the kept previous and next token ids and the row-centred
    smoothed log-probabilities ``[len(rows), len(cols)]`` in float64. ``sequences``: token
    id lists or 1-D integer tensors; ``masks``: their loss masks, where given only pairs of
    two supervised tokens count (else every adjacent pair)."""
    pairs: Counter[tuple[int, int]] = Counter()
    sequences = list(sequences)
    masks = [None] * len(sequences) if masks is None else list(masks)
    if len(masks) != len(sequences):
        raise ValueError(f"{len(masks)} loss masks for {len(sequences)} sequences")
    for ids, mask in zip(sequences, masks, strict=True):
        # Plain ints: the elements of a tensor (a Sample's input_ids) hash by identity, so
        # no pair would ever be counted twice.
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else [int(i) for i in ids]
        if mask is None:
            pairs.update(zip(ids, ids[1:], strict=False))
            continue
        mask = mask.tolist() if isinstance(mask, torch.Tensor) else [bool(m) for m in mask]
        if len(mask) != len(ids):
            raise ValueError(f"a loss mask of {len(mask)} positions for {len(ids)} tokens")
        pairs.update((ids[j], ids[j + 1]) for j in range(len(ids) - 1) if mask[j] and mask[j + 1])
    prev_count: Counter[int] = Counter()
    next_count: Counter[int] = Counter()
    for (a, b), count in pairs.items():
        prev_count[a] += count
        next_count[b] += count
    if not pairs:
        raise InputError(
            "train.markov_init: bigram: the training samples hold no token pair (of two supervised "
            "tokens); use more samples or train.markov_init=random"
        )
    rows = sorted(a for a, c in prev_count.most_common(max_tokens) if c >= 2)
    if not rows:
        raise InputError(
            f"train.markov_init: bigram: too little data for a bigram table: no previous token occurs "
            f"twice in the {sum(pairs.values())} token pair(s) of the training samples; use more "
            "samples or train.markov_init=random"
        )
    cols = sorted(b for b, _ in next_count.most_common(max_tokens))
    row_index = {a: i for i, a in enumerate(rows)}
    col_index = {b: j for j, b in enumerate(cols)}
    counts = torch.zeros(len(rows), len(cols), dtype=torch.float64)
    for (a, b), count in pairs.items():
        i, j = row_index.get(a), col_index.get(b)
        if i is not None and j is not None:
            counts[i, j] = count
    total = sum(next_count.values())
    unigram = torch.tensor([next_count[b] / total for b in cols], dtype=torch.float64)
    row_totals = torch.tensor([prev_count[a] for a in rows], dtype=torch.float64)[:, None]
    # in place: the table is up to 8192^2 float64 (0.5 GiB), and each out-of-place step held
    # another copy (a peak of three tables, 1.5 GiB, measured)
    scores = counts.add_(unigram).div_(row_totals + 1.0).log_()
    scores -= scores.mean(dim=1, keepdim=True)
    return torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long), scores


def _truncated_svd(
    scores: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u, s, v) of the best approximation of ``scores`` of rank at most ``rank``
    (randomised SVD, seeded), without the directions whose singular value is rounding noise
    (at most ``s[0] * max(shape) * eps``, as ``torch.linalg.matrix_rank``): the centred table
    has rank at most its number of next tokens less one, and such a direction would put two
    all-but-zero columns in ``W1`` and ``W2``, each giving the other hardly any gradient."""
    rank = min(rank, *scores.shape)
    with torch.random.fork_rng(devices=[]):  # randomised SVD, oversampled for accuracy
        torch.manual_seed(SVD_SEED)
        u, s, v = torch.svd_lowrank(scores, q=min(rank + OVERSAMPLE, *scores.shape), niter=6)
    noise = float(s[0]) * max(scores.shape) * torch.finfo(scores.dtype).eps
    rank = min(rank, int((s > noise).sum()))
    return u[:, :rank], s[:rank], v[:, :rank]


@torch.no_grad()
def init_markov_bigram(model, sequences: Iterable[Sequence[int]],
                       masks: Iterable[Sequence[bool]] | None = None) -> str:
    """Overwrite the draft's ``markov_w1``/``markov_w2`` with the rank-r bigram of
    ``sequences`` (token id lists; with ``masks``, their supervised pairs only: see
    :func:`bigram_scores`); returns a one-line description for the log."""
    head = model.markov_head
    if head is None or head.head_type == "rnn":
        raise ValueError(
            "train.markov_init: bigram needs a vanilla or gated Markov head "
            "(draft.markov_rank > 0, draft.markov_head_type vanilla or gated)"
        )
    rows, cols, scores = bigram_scores(sequences, masks=masks)
    energy = float((scores**2).sum())
    if energy == 0.0:
        # Every kept previous token scores the next tokens alike (one next token, say): the
        # centred table is zero, a rank-0 table: W2 zero, W1 keeps its random init, all learn.
        head.markov_w2.weight.zero_()
        if head.head_type == "gated":
            head.gate_proj.weight.zero_()
            head.gate_proj.bias.zero_()
        return (
            f"markov head initialised as a bigram of the training answers: {len(rows)} previous x "
            f"{len(cols)} next tokens, whose centred table is all zeros (every previous token "
            "predicts the same next tokens): the head starts with no correction"
        )
    u, s, v = _truncated_svd(scores, head.rank)
    rank = len(s)
    root = s.sqrt()
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    # Below the head's rank, W1's spare columns keep their random init and W2's are zero:
    # the table stays exact, and W2's spare columns still get a gradient (W1[prev] is not
    # zero there), so the head can grow past the table's rank.
    w1[:, :rank] = 0.0
    w2.zero_()
    w1[rows, :rank] = (u * root).to(w1.dtype)
    w2[cols, :rank] = (v * root).to(w2.dtype)
    if head.head_type == "gated":  # gate exactly 1/2 everywhere, W2 doubled: the same table
        head.gate_proj.weight.zero_()
        head.gate_proj.bias.zero_()
        w2.mul_(2.0)
    kept = float((s**2).sum()) / energy
    return (
        f"markov head initialised as a rank-{rank} bigram of the training answers: "
        f"{len(rows)} previous x {len(cols)} next tokens, {kept:.0%} of the table's energy"
    )
