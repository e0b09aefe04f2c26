"""The baselines measured beside the draft on the same prompts in the same run.

* ``NoDraft``: plain autoregressive decoding with the target's KV cache, one
  token per round (acceptance length 1 by definition); its wall time is the
  speed-up reference and its greedy output the lossless reference.
* ``NgramProposer``: prompt lookup decoding, the standard model-free drafter:
  the tokens that followed the latest earlier occurrence of the sequence's
  last n-gram, verified exactly like the draft's tokens. As vLLM's ``ngram``
  proposer: the most recent match, its continuation cut where the sequence ends
  (so in a loop shorter than the block it proposes one period). transformers'
  prompt lookup takes the earliest match instead, and SGLang's ``NGRAM`` keeps a
  trie over every request and proposes trees: a stronger drafter than either.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftforge.eval.speculative import Proposal, Proposer


class NoDraft(Proposer):
    """Proposes nothing: the loop degenerates to plain decoding."""

    name = "none"


class NgramProposer(Proposer):
    """Prompt lookup of up to ``num_tokens`` tokens, longest n-gram first (``max_ngram`` .. ``min_ngram``)."""

    name = "ngram"

    def __init__(self, num_tokens: int, *, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if num_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"n-gram lookup needs num_tokens >= 1 and 1 <= min_ngram <= max_ngram, got "
                f"{num_tokens}, {min_ngram}, {max_ngram}"
            )
        self.num_tokens = num_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, sequence: list[int], features: torch.Tensor | None = None) -> Proposal:
        return Proposal(tokens=ngram_lookup(sequence, self.num_tokens, self.max_ngram, self.min_ngram))


def ngram_lookup(
    sequence: Sequence[int], num_tokens: int, max_ngram: int = 3, min_ngram: int = 1
) -> list[int]:
    """The continuation of the latest earlier match of the sequence's suffix n-gram (longest n first)."""
    length = len(sequence)
    tokens = list(sequence)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + num_tokens]
    return []
