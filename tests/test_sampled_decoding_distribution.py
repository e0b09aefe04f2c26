"""Sampled speculative decoding, the whole loop: its output follows the target's distribution.

``test_eval_speculative.py`` checks the acceptance rule (``rejection_accept``) alone; here the
loop of ``speculative_decode`` runs end to end (prefill, rounds, verification, cropping, the
bonus token, the output cut at ``max_new_tokens``) on a stub target whose next-token logits
depend on the last token and its position, so the exact distribution of every output position
follows from a Markov chain computed by hand below, in float64 and without the module's
``sampling_probs``.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from draftforge.eval.speculative import DecodeSettings, Proposal, Proposer, speculative_decode

VOCAB = 6
PROMPT = [3, 1]
MAX_NEW = 4  # output 0 from the prefill, 1-2 from the first round's drafts, 3 after them
GAMMA = 2  # with MAX_NEW 4 the bonus after a fully accepted block is reached (output 3)
NUM_POSITIONS = len(PROMPT) + MAX_NEW + GAMMA
NUM_DECODES = 4000
CHI2_CRIT_BY_DF = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}  # p = 0.001


def _random_logits(seed: int, scale: float) -> list[list[list[float]]]:
    """[position][previous token][next token] logits, float32-representable (what the stub returns)."""
    rng = random.Random(seed)
    rows = [[[rng.gauss(0.0, scale) for _ in range(VOCAB)] for _ in range(VOCAB)] for _ in range(NUM_POSITIONS)]
    return torch.tensor(rows, dtype=torch.float32).double().tolist()


TARGET_LOGITS = _random_logits(11, 1.5)
# the draft: the target's logits plus noise, so drafts are often but not always accepted
DRAFT_LOGITS = [
    [[t + d for t, d in zip(trow, drow, strict=True)] for trow, drow in zip(tpos, dpos, strict=True)]
    for tpos, dpos in zip(TARGET_LOGITS, _random_logits(12, 1.2), strict=True)
]


def cut_distribution(logits: list[float], temperature: float, top_k: int, top_p: float, *,
                     clear_of_boundary: bool = True) -> list[float]:
    """softmax(logits / T), then the top_k most likely tokens (all when 0) renormalised, then the
    most likely of those while the mass before a token is below top_p, renormalised.
    ``clear_of_boundary``: refuse a cut so close to top_p that float32 could fall either way."""
    scaled = [value / temperature for value in logits]
    peak = max(scaled)
    weights = [math.exp(value - peak) for value in scaled]
    total = sum(weights)
    probs = [w / total for w in weights]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = order[:top_k] if 0 < top_k < len(probs) else order
    mass = sum(probs[i] for i in kept)
    nucleus, before = [], 0.0
    for i in kept:
        if top_p < 1.0 and before >= top_p:
            break
        # a cut this close to the boundary could fall either way in float32: choose other logits
        assert not clear_of_boundary or top_p >= 1.0 or abs(before - top_p) > 1e-4
        nucleus.append(i)
        before += probs[i] / mass
    nucleus_mass = sum(probs[i] for i in nucleus)
    return [probs[i] / nucleus_mass if i in nucleus else 0.0 for i in range(len(probs))]


def output_marginals(temperature: float, top_k: int, top_p: float) -> list[list[float]]:
    """The exact distribution of each output index: output j is the token at position
    len(PROMPT) + j, drawn from the row of the token before it."""
    def row(position, previous):
        return cut_distribution(TARGET_LOGITS[position][previous], temperature, top_k, top_p)

    last = len(PROMPT) - 1
    marginals = [row(last, PROMPT[-1])]
    for j in range(1, MAX_NEW):
        previous = marginals[-1]
        marginals.append([
            sum(previous[a] * row(last + j, a)[b] for a in range(VOCAB)) for b in range(VOCAB)
        ])  # fmt: skip
    return marginals


class MarkovTarget:
    """A target with a KV cache whose next-token logits at position i depend only on the token at
    position i and on i: what the cache holds after crop decides the logits of later tokens."""

    def __init__(self) -> None:
        self.table = torch.tensor(TARGET_LOGITS, dtype=torch.float32)
        self.tokens: list[int] = []

    def _run(self, token_ids):
        start = len(self.tokens)
        self.tokens.extend(token_ids)
        return torch.stack([self.table[start + i, t] for i, t in enumerate(token_ids)]), None

    def prefill(self, token_ids):
        self.tokens = []
        return self._run(list(token_ids))

    def extend(self, token_ids):
        return self._run(list(token_ids))

    def crop(self, length: int) -> None:
        assert length <= len(self.tokens), (length, len(self.tokens))
        del self.tokens[length:]


class MarkovDraft(Proposer):
    """Drafts GAMMA tokens after the anchor from its own Markov chain (DRAFT_LOGITS, cut like the
    target's): drawn, with the rows they were drawn from (``draft_sampling: sample``), or the most
    likely token of each row with no distributions (``greedy``, deterministic drafts)."""

    name = "markov-draft"

    def __init__(self, draws: bool, temperature: float, top_k: int, top_p: float, generator) -> None:
        self.draws, self.generator = draws, generator
        self.rows = torch.tensor([
            [cut_distribution(logits, temperature, top_k, top_p) for logits in position]
            for position in DRAFT_LOGITS
        ], dtype=torch.float32)  # fmt: skip

    def propose(self, sequence, features):
        position, previous = len(sequence) - 1, sequence[-1]
        tokens, rows = [], []
        for k in range(GAMMA):
            probs = self.rows[position + k, previous]
            if self.draws:
                previous = int(torch.multinomial(probs, 1, generator=self.generator))
            else:
                previous = int(probs.argmax())
            tokens.append(previous)
            rows.append(probs)
        return Proposal(tokens=tokens, probs=torch.stack(rows) if self.draws else None)


def first_draft_acceptance(draft_sampling: str, temperature: float, top_k: int, top_p: float) -> float:
    """The exact probability that the first round accepts its first draft: the anchor is output 0
    (at position len(PROMPT)), and a draft from q is accepted with probability sum_x min(p(x), q(x))
    under the standard rule, q one-hot at the draft for deterministic drafts. (Judging a drawn
    draft as if it were deterministic still leaves the output distribution exact, only this rate
    lower: the distribution test alone cannot tell that the loop dropped the draft's distributions.)"""
    anchor_position = len(PROMPT)
    first = cut_distribution(TARGET_LOGITS[anchor_position - 1][PROMPT[-1]], temperature, top_k, top_p)
    rate = 0.0
    for anchor in range(VOCAB):
        p = cut_distribution(TARGET_LOGITS[anchor_position][anchor], temperature, top_k, top_p)
        q = cut_distribution(DRAFT_LOGITS[anchor_position][anchor], temperature, top_k, top_p)
        if draft_sampling == "greedy":
            q = [1.0 if x == max(range(VOCAB), key=q.__getitem__) else 0.0 for x in range(VOCAB)]
        rate += first[anchor] * sum(min(px, qx) for px, qx in zip(p, q, strict=True))
    return rate


def _decode_many(draft_sampling: str, temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, int]:
    """Counts [MAX_NEW, VOCAB] of the token at each output index over NUM_DECODES decodes, and in
    how many of them the first round accepted its first draft."""
    settings = DecodeSettings(max_new_tokens=MAX_NEW, temperature=temperature, top_k=top_k, top_p=top_p)
    generator = torch.Generator().manual_seed(5)  # one stream across the decodes, not reseeded
    proposer = MarkovDraft(draft_sampling == "sample", temperature, top_k, top_p,
                           torch.Generator().manual_seed(6))  # fmt: skip
    target = MarkovTarget()
    counts = torch.zeros(MAX_NEW, VOCAB, dtype=torch.float64)
    first_accepted = 0
    for _ in range(NUM_DECODES):
        result = speculative_decode(target, PROMPT, proposer, settings, generator=generator)
        assert len(result.tokens) == MAX_NEW
        for index, token in enumerate(result.tokens):
            counts[index, token] += 1
        assert result.rounds[0].num_verified == GAMMA
        first_accepted += result.rounds[0].num_accepted >= 1
    return counts, first_accepted


@pytest.mark.parametrize("draft_sampling", ["sample", "greedy"])
@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (4, 0.8)])
def test_sampled_speculative_decoding_follows_the_target_at_every_output_index(draft_sampling, top_k, top_p):
    temperature = 1.0
    marginals = output_marginals(temperature, top_k, top_p)
    if top_k or top_p < 1.0:
        assert sum(p == 0.0 for p in marginals[0]) >= 2  # the cut removes tokens
    counts, first_accepted = _decode_many(draft_sampling, temperature, top_k, top_p)
    for index, probs in enumerate(marginals):
        row = counts[index]
        outside = [t for t in range(VOCAB) if probs[t] == 0.0 and row[t] > 0]
        assert not outside, f"output index {index} emitted tokens {outside} the cut target never gives"
        support = [t for t in range(VOCAB) if probs[t] > 0.0]
        chi2 = sum((row[t].item() - probs[t] * NUM_DECODES) ** 2 / (probs[t] * NUM_DECODES) for t in support)
        crit = CHI2_CRIT_BY_DF[len(support) - 1]
        assert chi2 < crit, (f"output index {index} does not follow the target: chi2 {chi2:.1f} >= {crit}; "
                             f"counts {row.tolist()}, expected {[p * NUM_DECODES for p in probs]}")
    # the acceptance the rule promises for the draft's distributions (4.5 binomial standard errors)
    rate = first_draft_acceptance(draft_sampling, temperature, top_k, top_p)
    assert 0.1 < rate < 0.9  # both branches of the rule are exercised
    error = math.sqrt(rate * (1 - rate) / NUM_DECODES)
    assert abs(first_accepted / NUM_DECODES - rate) < 4.5 * error, (
        f"the first draft was accepted in {first_accepted / NUM_DECODES:.3f} of the decodes, "
        f"the rule gives {rate:.3f}")
