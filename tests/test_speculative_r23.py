"""Review round 23: independent references for the verifier, the decoding loop and n-gram lookup.

* the output distribution of ``rejection_accept`` computed exactly (every accept/reject branch
  and residual draw enumerated, each draft sequence weighted by its probability), completed with
  the target to a fixed length and compared with the target's own joint distribution, for drawn
  and deterministic drafts under temperature, top-k and top-p;
* the loop against plain greedy decoding on a stub target whose logits depend on the whole
  prefix its cache holds (so a wrong crop changes later logits), with EOS and max_new_tokens;
* ``ngram_lookup`` against a brute-force search (longest n, latest or earliest match, length).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from test_sampled_decoding_distribution import cut_distribution as sampled_reference_cut

import draftforge.eval.speculative as spec
from draftforge.eval.baselines import ngram_lookup

VOCAB = 4
NUM_DRAFTS = 2


def cut_distribution(logits, temperature, top_k, top_p):
    """The independent cut of tests/test_sampled_decoding_distribution.py (softmax(logits / T),
    top_k, then the nucleus), on cases that may lie near the top_p boundary."""
    return sampled_reference_cut(logits, temperature, top_k, top_p, clear_of_boundary=False)


class _Decision(float):
    """What ``torch.rand(()).item()`` returns under enumeration: ``<`` records the acceptance
    threshold it is compared with and answers the scripted branch."""

    script: list[bool] = []
    thresholds: list[float] = []

    def __lt__(self, other):
        _Decision.thresholds.append(float(other))
        return _Decision.script.pop(0)


class _EnumeratingTorch:
    """Stands in for ``torch`` inside the module: scripted uniform draws and multinomial choices."""

    def __init__(self) -> None:
        self.choice = 0
        self.drawn_from: list[torch.Tensor] = []

    def __getattr__(self, name):
        return getattr(torch, name)

    def rand(self, *args, **kwargs):
        class _Value:
            def item(self):
                return _Decision(0.5)

        return _Value()

    def multinomial(self, probs, num, generator=None):
        self.drawn_from.append(probs.clone())
        return torch.tensor([self.choice])


def exact_accept_distribution(drafts, draft_probs, target_probs, fake):
    """{emitted tokens: probability} of one ``rejection_accept`` call, every branch enumerated."""
    result: dict[tuple[int, ...], float] = {}
    for accepted in range(len(drafts) + 1):
        decisions = [True] * accepted + ([False] if accepted < len(drafts) else [])

        def run(choice, decisions=decisions):
            _Decision.script, _Decision.thresholds = list(decisions), []
            fake.choice, fake.drawn_from = choice, []
            k, bonus = spec.rejection_accept(drafts, draft_probs, target_probs, torch.Generator())
            return k, bonus, list(_Decision.thresholds), fake.drawn_from[0]

        _, _, thresholds, residual = run(0)
        weight = 1.0
        for decision, threshold in zip(decisions, thresholds, strict=True):
            a = min(1.0, max(0.0, threshold))
            weight *= a if decision else 1.0 - a
        if weight == 0:
            continue
        residual = residual / residual.sum()
        for token in range(VOCAB):
            if residual[token] > 0:
                k, bonus, _, _ = run(token)
                emitted = tuple(drafts[:k]) + (bonus,)
                result[emitted] = result.get(emitted, 0.0) + weight * float(residual[token])
    return result


@pytest.mark.parametrize("draft_sampling", ["sample", "greedy"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 2, 1.0), (1.3, 0, 0.8), (0.8, 3, 0.7)])
def test_rejection_sampling_output_is_exactly_the_targets_joint_distribution(
    monkeypatch, draft_sampling, temperature, top_k, top_p
):
    rng = random.Random(1)
    target_table, draft_table = {}, {}

    def logits(table, prefix):
        if prefix not in table:
            table[prefix] = [rng.gauss(0.0, 1.5) for _ in range(VOCAB)]
        return table[prefix]

    def target_row(prefix):
        return cut_distribution(logits(target_table, prefix), temperature, top_k, top_p)

    def draft_row(prefix):
        return cut_distribution(logits(draft_table, prefix), temperature, top_k, top_p)

    fake = _EnumeratingTorch()
    monkeypatch.setattr(spec, "torch", fake)
    completed: dict[tuple[int, ...], float] = {}

    def complete(emitted, weight):  # continue with the target to NUM_DRAFTS + 1 tokens
        if len(emitted) == NUM_DRAFTS + 1:
            completed[emitted] = completed.get(emitted, 0.0) + weight
            return
        for token, p in enumerate(target_row(emitted)):
            if p > 0:
                complete(emitted + (token,), weight * p)

    if draft_sampling == "sample":
        candidates = list(itertools.product(range(VOCAB), repeat=NUM_DRAFTS))
    else:  # the draft's most likely token at each slot, deterministic
        greedy, prefix = [], ()
        for _ in range(NUM_DRAFTS):
            row = logits(draft_table, prefix)
            greedy.append(max(range(VOCAB), key=row.__getitem__))
            prefix += (greedy[-1],)
        candidates = [tuple(greedy)]
    for drafts in candidates:
        if draft_sampling == "sample":
            weight = math.prod(draft_row(drafts[:i])[drafts[i]] for i in range(NUM_DRAFTS))
            if weight == 0:
                continue
            draft_probs = torch.tensor([draft_row(drafts[:i]) for i in range(NUM_DRAFTS)], dtype=torch.float64)
        else:
            weight, draft_probs = 1.0, None
        target_probs = torch.tensor([target_row(drafts[:i]) for i in range(NUM_DRAFTS + 1)], dtype=torch.float64)
        for emitted, p in exact_accept_distribution(list(drafts), draft_probs, target_probs, fake).items():
            complete(emitted, weight * p)

    reference = {}
    for seq in itertools.product(range(VOCAB), repeat=NUM_DRAFTS + 1):
        p = math.prod(target_row(seq[:i])[seq[i]] for i in range(NUM_DRAFTS + 1))
        if p > 0:
            reference[seq] = p
    distance = sum(abs(completed.get(s, 0.0) - reference.get(s, 0.0)) for s in set(completed) | set(reference))
    assert distance < 1e-12


def test_sampling_probs_equal_an_independent_cut():
    rng = random.Random(0)
    for _ in range(500):
        row = [rng.gauss(0.0, 2.0) for _ in range(7)]
        temperature = rng.choice([0.3, 0.7, 1.0, 1.5])
        top_k, top_p = rng.choice([0, 1, 2, 3, 7, 9]), rng.choice([1.0, 0.95, 0.8, 0.5, 0.1])
        got = spec.sampling_probs(torch.tensor(row, dtype=torch.float64), temperature, top_k, top_p).tolist()
        assert got == pytest.approx(cut_distribution(row, temperature, top_k, top_p), abs=1e-6)


# ----------------------------------------------------------------------------- the greedy loop

LOOP_VOCAB, LOOP_EOS = 5, 4


def _prefix_logits(prefix) -> torch.Tensor:
    return torch.randn(LOOP_VOCAB, generator=torch.Generator().manual_seed(hash(tuple(prefix)) % 2**31))


class PrefixTarget:
    """A cached target whose logits depend on every token its cache holds: a crop that keeps a
    rejected draft, or drops an accepted one, changes every later logit."""

    def prefill(self, ids):
        self.tokens = list(ids)
        return _prefix_logits(self.tokens)[None], None

    def extend(self, ids):
        rows = []
        for token in ids:
            self.tokens.append(token)
            rows.append(_prefix_logits(self.tokens))
        return torch.stack(rows), None

    def crop(self, length):
        assert length <= len(self.tokens)
        del self.tokens[length:]


class MixedDrafts(spec.Proposer):
    """Drafts the target's greedy continuation with some wrong tokens; records what it saw."""

    name = "mixed"

    def __init__(self, seed, gamma):
        self.rng, self.gamma, self.seen = random.Random(seed), gamma, []

    def propose(self, sequence, features):
        self.seen.append(list(sequence))
        tokens, prefix = [], list(sequence)
        for _ in range(self.gamma):
            good = self.rng.random() < 0.8
            token = int(_prefix_logits(prefix).argmax()) if good else self.rng.randrange(LOOP_VOCAB)
            tokens.append(token)
            prefix.append(token)
        return spec.Proposal(tokens=tokens)


def _plain_greedy(prompt, max_new, eos):
    sequence, out = list(prompt), []
    while len(out) < max_new:
        token = int(_prefix_logits(sequence).argmax())
        out.append(token)
        sequence.append(token)
        if token in eos:
            break
    return out


def test_greedy_loop_is_plain_greedy_and_counts_rounds_as_the_readme_says():
    for seed in range(600):
        rng = random.Random(seed)
        prompt = [rng.randrange(LOOP_VOCAB) for _ in range(rng.randint(1, 4))]
        max_new, gamma = rng.randint(1, 12), rng.randint(1, 4)
        eos = (LOOP_EOS,) if rng.random() < 0.7 else ()
        target, proposer = PrefixTarget(), MixedDrafts(seed, gamma)
        res = spec.speculative_decode(target, prompt, proposer, spec.DecodeSettings(max_new_tokens=max_new,
                                                                                  eos_token_ids=eos))
        assert res.tokens == _plain_greedy(prompt, max_new, eos)
        # every round drafts after exactly the prompt and the output so far
        for seen in proposer.seen:
            assert seen == list(prompt) + res.tokens[: len(seen) - len(prompt)]
        emitted = 1 + sum(r.acceptance_length for r in res.rounds)
        if res.rounds:  # rounds run only while the output is short of max_new_tokens and has no EOS
            assert emitted - res.rounds[-1].acceptance_length < max_new
        assert emitted == len(res.tokens) or (emitted > max_new and len(res.tokens) == max_new)
        for r in res.rounds:
            assert 1 <= r.acceptance_length <= gamma + 1
            assert r.num_accepted <= r.num_verified <= r.num_proposed
        if eos and LOOP_EOS in res.tokens:
            assert res.tokens.index(LOOP_EOS) == len(res.tokens) - 1


# ----------------------------------------------------------------------------- n-gram lookup


def _brute_force_lookup(sequence, num_tokens, max_ngram, min_ngram, match):
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > len(sequence) - 1:
            continue
        suffix = sequence[len(sequence) - n :]
        starts = [s for s in range(len(sequence) - n) if sequence[s : s + n] == suffix]
        if starts:
            start = max(starts) if match == "latest" else min(starts)
            return sequence[start + n : start + n + num_tokens]
    return []


def random_lookup_cases(seed: int, count: int, max_length: int):
    """``count`` random n-gram lookup cases ``(sequence, num_tokens, min_ngram, max_ngram)``:
    sequences of up to ``max_length`` tokens over 1 to 4 symbols, so that matches are common."""
    rng = random.Random(seed)
    for _ in range(count):
        sequence = [rng.randrange(rng.randint(1, 4)) for _ in range(rng.randint(0, max_length))]
        num_tokens, min_ngram = rng.randint(1, 6), rng.randint(1, 3)
        yield sequence, num_tokens, min_ngram, rng.randint(min_ngram, 5)


def test_ngram_lookup_equals_a_brute_force_search():
    for sequence, num_tokens, min_ngram, max_ngram in random_lookup_cases(0, 5000, 14):
        for match in ("latest", "earliest"):
            assert ngram_lookup(sequence, num_tokens, max_ngram, min_ngram, match) == _brute_force_lookup(
                sequence, num_tokens, max_ngram, min_ngram, match
            )
