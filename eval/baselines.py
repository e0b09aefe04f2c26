"""The baselines measured beside the draft on the same prompts in the same run.

* ``NoDraft``: plain autoregressive decoding with the target's KV cache, one
  token per round (acceptance length 1 by definition); its wall time is the
  speed-up reference and its greedy output the lossless reference.
* ``NgramProposer``: prompt lookup decoding, the standard model-free drafter:
  the tokens that followed the latest earlier occurrence of the sequence's
  last n-gram, verified exactly like the draft's tokens: the longest suffix
  n-gram first, its most recent earlier match, the continuation cut where the
  sequence ends (so in a loop shorter than the block it proposes one period).
  vLLM's ``ngram`` proposer and transformers' prompt lookup take the earliest
  match of the longest n-gram instead (``ngram_lookup(..., match="earliest")``
  is that rule, tested against a port of vLLM's search), and SGLang's ``NGRAM``
  keeps a trie over every request and proposes trees: a stronger drafter than
  either.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftforge.eval.config import NGRAM_MATCHES
from draftforge.eval.speculative import Proposal, Proposer


class NoDraft(Proposer):
    """Proposes nothing: the loop degenerates to plain decoding."""

    name = "none"


class NgramProposer(Proposer):
    """Prompt lookup of up to ``num_tokens`` tokens, longest n-gram first (``max_ngram`` .. ``min_ngram``)."""

    name = "ngram"

    def __init__(
        self, num_tokens: int, *, max_ngram: int = 3, min_ngram: int = 1, match: str = "latest"
    ) -> None:
        if num_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"n-gram lookup needs num_tokens >= 1 and 1 <= min_ngram <= max_ngram, got "
                f"{num_tokens}, {min_ngram}, {max_ngram}"
            )
        if match not in NGRAM_MATCHES:
            raise ValueError(f"n-gram match must be one of {', '.join(NGRAM_MATCHES)}, got {match!r}")
        self.num_tokens = num_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.match = match

    def propose(self, sequence: list[int], features: torch.Tensor | None = None) -> Proposal:
        tokens = ngram_lookup(sequence, self.num_tokens, self.max_ngram, self.min_ngram, self.match)
        return Proposal(tokens=tokens)


def ngram_lookup(
    sequence: Sequence[int],
    num_tokens: int,
    max_ngram: int = 3,
    min_ngram: int = 1,
    match: str = "latest",
) -> list[int]:
    """The continuation of an earlier match of the sequence's suffix n-gram, longest n first.

    ``match``: which earlier occurrence of that n-gram, the most recent (``latest``) or the
    first in the sequence (``earliest``, vLLM's and transformers' rule). The continuation
    is at most ``num_tokens`` long and stops where the sequence does.
    """
    length = len(sequence)
    tokens = list(sequence)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - n :]
        starts = range(length - n - 1, -1, -1) if match == "latest" else range(length - n)
        for start in starts:
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + num_tokens]
    return []
