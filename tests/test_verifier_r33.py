"""Review round 33 of the verifier: independent checks of what earlier rounds left open.

* the loop's per-round counts (accepted, verified, sent, acceptance length) and the per-position
  summary against a slow simulation of the rules, with full and threshold verification,
  proposals of every width (none included), end of sequence and the token limit;
* rollback on a linear-attention target when the first round sends the anchor alone and later
  rounds send more (the cache must be told to keep more states as rounds grow);
* the sampled loop under threshold verification hands the acceptance rule exactly the verified
  drafts, their own distributions and the target's cut rows of ``[anchor, drafts]``;
* the draft's sampled proposals are drawn from the distributions they report (top-k, top-p);
* ``ngram_lookup(..., match="earliest")`` against a port of vLLM's KMP search.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_regen_r7 import _hybrid_target  # Ling-3.0's architecture in small
from test_speculative_r23 import LOOP_EOS as EOS  # the same 5-token stub target as round 23's
from test_speculative_r23 import LOOP_VOCAB as V
from test_speculative_r23 import PrefixTarget as _CachedStub
from test_speculative_r23 import _prefix_logits as _logits
from test_speculative_r23 import random_lookup_cases

import draftforge.eval.speculative as spec
from draftforge.eval.baselines import NoDraft, ngram_lookup
from draftforge.eval.harness import summarize

# ----------------------------------------------------------------------------- counts of the loop


def _greedy(prefix) -> int:
    return int(_logits(prefix).argmax())


class _Scripted(spec.Proposer):
    """Drafts of random width 0..gamma, mostly the target's greedy tokens, with confidences."""

    name = "scripted"

    def __init__(self, seed, gamma):
        self.rng, self.gamma, self.proposals = random.Random(seed), gamma, []

    def propose(self, sequence, features):
        tokens, prefix = [], list(sequence)
        for _ in range(self.rng.randint(0, self.gamma)):
            token = _greedy(prefix) if self.rng.random() < 0.75 else self.rng.randrange(V)
            tokens.append(token)
            prefix.append(token)
        conf = [self.rng.gauss(0.0, 2.0) for _ in tokens]
        self.proposals.append((tokens, conf))
        return spec.Proposal(tokens=tokens, confidence_logits=conf)


def _simulate(prompt, proposals, max_new, eos, verify, threshold):
    """The rules restated: [(accepted, verified, sent, acceptance length)] per round and the output."""
    sequence = list(prompt) + [_greedy(prompt)]
    output, rounds = [sequence[-1]], []
    for tokens, conf in proposals:
        if len(output) >= max_new or output[-1] in eos:
            break
        cut = len(tokens)
        if verify == "threshold":
            cut = next((k for k, z in enumerate(conf) if 1.0 / (1.0 + math.exp(-z)) < threshold), len(tokens))
        drafts = tokens[:cut]
        accepted = 0
        while accepted < cut and drafts[accepted] == _greedy(sequence + drafts[:accepted]):
            accepted += 1
        emitted = drafts[:accepted] + [_greedy(sequence + drafts[:accepted])]
        ends = [i for i, t in enumerate(emitted) if t in eos]
        if ends:
            emitted = emitted[: ends[0] + 1]
        if ends and ends[0] < accepted:  # an accepted draft ends the answer
            rounds.append((len(emitted), len(emitted), cut, len(emitted)))
        else:
            rounds.append((accepted, cut, cut, len(emitted)))
        sequence += emitted
        output += emitted
    return rounds, output[:max_new]


def test_rounds_and_position_counts_equal_a_simulation_of_the_rules():
    gamma = 4
    seen_threshold_cut = seen_eos_draft = seen_empty = 0
    for seed in range(400):
        rng = random.Random(1000 + seed)
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 4))]
        max_new = rng.randint(1, 14)
        eos = (EOS,) if rng.random() < 0.6 else ()
        verify = rng.choice(["full", "threshold"])
        threshold = rng.choice([0.2, 0.5, 0.8])
        proposer = _Scripted(seed, gamma)
        settings = spec.DecodeSettings(max_new_tokens=max_new, eos_token_ids=eos, verify=verify, threshold=threshold)
        result = spec.speculative_decode(_CachedStub(), prompt, proposer, settings)
        expected, output = _simulate(prompt, proposer.proposals, max_new, eos, verify, threshold)
        got = [(r.num_accepted, r.num_verified, r.num_sent, r.acceptance_length) for r in result.rounds]
        assert got == expected, (seed, got, expected)
        assert result.tokens == output
        assert [r.num_proposed for r in result.rounds] == [len(t) for t, _ in proposer.proposals]
        # per-position conditional acceptance: slot k is reached when verified and every earlier
        # slot was accepted, accepted when the run is longer than k
        summary = summarize([result], gamma)
        reached = [sum(1 for a, v, _, _ in expected if k < v and k <= a) for k in range(gamma)]
        accepted = [sum(1 for a, v, _, _ in expected if k < v and k < a) for k in range(gamma)]
        assert summary["position_reached"] == reached
        assert summary["position_acceptance"] == [a / n if n else None for a, n in zip(accepted, reached, strict=True)]
        if expected:
            assert summary["tokens_verified_per_round"] == pytest.approx(
                sum(s + 1 for _, _, s, _ in expected) / len(expected))
        seen_threshold_cut += any(s < len(t) for (_, _, s, _), (t, _) in zip(expected, proposer.proposals, strict=True))
        seen_eos_draft += any(v < s for _, v, s, _ in expected)
        seen_empty += any(not t for t, _ in proposer.proposals[: len(expected)])
    assert seen_threshold_cut > 20 and seen_eos_draft > 5 and seen_empty > 20


# ----------------------------------------------------------------------------- rollback, growing widths


class _Widths(spec.Proposer):
    """The reference continuation in rounds of the given widths, wrong after a cut."""

    name, needs_features = "widths", True

    def __init__(self, reference, widths, cuts):
        self.reference, self.widths, self.cuts, self.calls = reference, widths, cuts, []

    def propose(self, sequence, features):
        i = len(self.calls) % len(self.widths)
        self.calls.append((len(sequence), features.clone()))
        cont = self.reference[len(sequence) : len(sequence) + self.widths[i]]
        cut = min(self.cuts[i], len(cont))
        return spec.Proposal(tokens=cont[:cut] + [(t + 1) % 64 for t in cont[cut:]])


def test_a_linear_attention_target_rolls_back_rounds_wider_than_the_first():
    """The first round sends the anchor alone (an n-gram lookup that finds nothing, a threshold
    that cuts every draft); the cache must then keep more recurrent states for the wider rounds
    after it, or their rollback fails (or restores a wrong state)."""
    model = _hybrid_target()  # seeded, in eval mode, its lm_head spread out (no near-ties)
    prompt = [5, 9, 3, 7, 2, 8, 4, 6, 11, 12]
    plain = spec.speculative_decode(spec.TargetSession(model, None), prompt, NoDraft(),
                                    spec.DecodeSettings(max_new_tokens=20))
    full = prompt + plain.tokens
    proposer = _Widths(full, widths=[0, 1, 5, 2, 5, 3], cuts=[0, 0, 2, 2, 5, 1])
    session = spec.TargetSession(model, [0, 2, 4])
    result = spec.speculative_decode(session, prompt, proposer, spec.DecodeSettings(max_new_tokens=20))
    assert spec.check_lossless(result, plain, tie_tolerance=0.0) == 0
    assert [r.num_sent for r in result.rounds][:6] == [0, 1, 5, 2, 5, 3]
    assert [r.num_accepted for r in result.rounds][:6] == [0, 0, 2, 2, 5, 1]
    _, aux = spec.TargetSession(model, [0, 2, 4]).prefill(full)
    for length, features in proposer.calls:
        torch.testing.assert_close(features, aux[: length - 1], rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- sampled, threshold


def test_sampled_threshold_rounds_judge_the_verified_drafts_with_their_own_rows():
    temperature, top_k, top_p = 0.8, 3, 0.9
    gen = torch.Generator().manual_seed(3)

    class Drawn(spec.Proposer):
        name = "drawn"

        def __init__(self):
            self.proposals = []

        def propose(self, sequence, features):
            probs = torch.softmax(torch.randn(4, V, generator=gen), dim=-1)
            tokens = [int(torch.multinomial(row, 1, generator=gen)) for row in probs]
            conf = torch.randn(4, generator=gen).mul(2).tolist()
            self.proposals.append((list(sequence), tokens, probs, conf))
            return spec.Proposal(tokens=tokens, probs=probs, confidence_logits=conf)

    calls = []

    def recording_accept(drafts, draft_probs, target_probs, generator):
        calls.append((list(drafts), None if draft_probs is None else draft_probs.clone(), target_probs.clone()))
        return spec.rejection_accept(drafts, draft_probs, target_probs, generator)

    proposer = Drawn()
    settings = spec.DecodeSettings(max_new_tokens=30, temperature=temperature, top_k=top_k, top_p=top_p,
                                   verify="threshold", threshold=0.5)
    result = spec.speculative_decode(_CachedStub(), [1, 2], proposer, settings, accept_sampled=recording_accept)
    assert len(calls) == len(result.rounds) == len(proposer.proposals) >= 5
    cuts = set()
    for (sequence, tokens, probs, conf), (drafts, draft_probs, target_probs), r in zip(
            proposer.proposals, calls, result.rounds, strict=True):
        cut = next((k for k, z in enumerate(conf) if z < 0.0), 4)  # sigmoid(z) < 0.5
        cuts.add(cut)
        assert drafts == tokens[:cut] and r.num_sent == cut
        torch.testing.assert_close(draft_probs, probs[:cut])
        rows = torch.stack([_logits(sequence + tokens[:i]) for i in range(cut + 1)])
        torch.testing.assert_close(target_probs, spec.sampling_probs(rows, temperature, top_k, top_p))
    assert len(cuts) >= 3


# ----------------------------------------------------------------------------- the draft's own draws


def test_the_drafts_sampled_tokens_follow_the_distributions_it_reports():
    """Rejection sampling is exact only if each draft token was drawn from the row the proposal
    reports for it: slot 0 (one row for every draw) and slot 1 (the row given slot 0's token)."""
    from eval_helpers import random_prompts, tiny_eval_draft, tiny_target

    target = tiny_target()
    draft = tiny_eval_draft(target)
    prompt = random_prompts(1, seed=4)[0]
    _, aux = spec.TargetSession(target.model, draft.config.target_layer_ids).prefill(prompt)
    proposer = spec.DraftProposer(draft, temperature=1.5, generator=torch.Generator().manual_seed(8),
                                  top_k=4, top_p=0.95, draft_sampling="sample")
    draws = 1000
    counts = torch.zeros(2, draft.config.vocab_size, dtype=torch.float64)
    expected = torch.zeros_like(counts)
    for _ in range(draws):
        proposal = proposer.propose(prompt, aux[:-1])
        for slot in range(2):
            counts[slot, proposal.tokens[slot]] += 1
            expected[slot] += proposal.probs[slot].double()
    for slot in range(2):
        support = expected[slot] > 0
        assert counts[slot][~support].sum() == 0, f"slot {slot} drew tokens outside its reported rows"
        assert 2 <= int(support.sum()) <= (4 if slot == 0 else draft.config.vocab_size)
        e = expected[slot][support]
        chi2 = float(((counts[slot][support] - e) ** 2 / e).sum())
        df = int(support.sum()) - 1
        crit = df + 4.5 * math.sqrt(2 * df) + 10  # far in the tail (p < 1e-4 for these df)
        assert chi2 < crit, (slot, chi2, crit)


# ----------------------------------------------------------------------------- n-gram lookup


def _vllm_kmp_lookup(origin, min_ngram, max_ngram, k):
    """vLLM's ``_find_longest_matched_ngram_and_propose_tokens`` (v1 n-gram proposer), ported:
    KMP over the reversed tokens; the longest match up to max_ngram, the furthest back on ties."""
    total = len(origin)
    if total < min_ngram:
        return []
    tokens = origin[::-1]
    lps = [0] * max_ngram
    longest = position = prev_lps = 0
    i = 1
    while i < total:
        if tokens[prev_lps] == tokens[i]:
            prev_lps += 1
            if prev_lps >= longest:
                longest, position = prev_lps, i
            if i < max_ngram:
                lps[i] = prev_lps
            if prev_lps == max_ngram:
                prev_lps = lps[max_ngram - 1]
            i += 1
        elif prev_lps != 0:
            prev_lps = lps[prev_lps - 1]
        else:
            i += 1
    if longest < min_ngram:
        return []
    start = total - 1 - position + longest
    return origin[start : start + min(k, total - start)]


def test_earliest_lookup_equals_a_port_of_vllms_kmp_search():
    for sequence, k, min_ngram, max_ngram in random_lookup_cases(33, 6000, 16):
        assert ngram_lookup(sequence, k, max_ngram, min_ngram, "earliest") == _vllm_kmp_lookup(
            sequence, min_ngram, max_ngram, k), (sequence, k, min_ngram, max_ngram)
