"""Round 45: the greedy speculative loop against a slow reference that runs the target without a
KV cache and counts every round by the contract (accepted drafts + 1 bonus; a round whose
accepted drafts hold the end of sequence counts up to it; the round reaching past
max_new_tokens counts its whole run, the output cut after it)."""

from __future__ import annotations

import random

import pytest
import torch
from eval_helpers import random_prompts, tiny_target

from draftforge.eval.speculative import (
    DecodeSettings,
    Proposal,
    Proposer,
    TargetSession,
    speculative_decode,
)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@torch.no_grad()
def _slow_greedy(model, prompt, count, eos):
    """Plain greedy decoding, the whole sequence re-run for every token (no cache)."""
    ids, out = list(prompt), []
    while len(out) < count:
        token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].float().argmax())
        out.append(token)
        ids.append(token)
        if token in eos:
            break
    return out


class _MostlyRight(Proposer):
    """Up to ``gamma`` drafts of random length, each the reference token with probability 0.8."""

    name = "mostly-right"

    def __init__(self, reference, prompt_len, gamma, seed):
        self.reference, self.prompt_len, self.gamma, self.rng = reference, prompt_len, gamma, random.Random(seed)

    def propose(self, sequence, features):
        produced = len(sequence) - self.prompt_len
        tokens = []
        for k in range(self.rng.randint(0, self.gamma)):
            i = produced + k
            right = i < len(self.reference) and self.rng.random() < 0.8
            tokens.append(self.reference[i] if right else self.rng.randrange(512))
        return Proposal(tokens=tokens)


def _reference_rounds(prompt, reference, proposer, max_new, eos):
    output, lengths = [reference[0]], []
    while len(output) < max_new and output[-1] not in eos:
        drafts = proposer.propose(list(prompt) + output, None).tokens
        truth = reference[len(output) :]
        accepted = 0
        while accepted < min(len(drafts), len(truth)) and drafts[accepted] == truth[accepted]:
            accepted += 1
        emitted = truth[: accepted + 1]
        for index, token in enumerate(emitted):
            if token in eos:
                emitted = emitted[: index + 1]
                break
        lengths.append(len(emitted))
        output += emitted
    return output[:max_new], lengths


@pytest.mark.parametrize("trial", range(12))
def test_greedy_loop_matches_a_slow_uncached_reference_round_by_round(target, trial):
    rng = random.Random(trial)
    prompt = random_prompts(1, length=rng.randint(1, 8), seed=trial)[0]
    gamma, max_new = rng.randint(1, 6), rng.randint(2, 16)
    unstopped = _slow_greedy(target.model, prompt, max_new + gamma + 2, ())
    eos = (rng.choice(unstopped[1:]),) if trial % 2 else ()
    reference = _slow_greedy(target.model, prompt, max_new + gamma + 2, eos)
    result = speculative_decode(
        TargetSession(target.model, None), prompt, _MostlyRight(reference, len(prompt), gamma, trial),
        DecodeSettings(max_new_tokens=max_new, eos_token_ids=eos),
    )  # fmt: skip
    output, lengths = _reference_rounds(prompt, reference, _MostlyRight(reference, len(prompt), gamma, trial),
                                        max_new, eos)
    assert result.tokens == output
    assert [r.acceptance_length for r in result.rounds] == lengths
    assert all(r.acceptance_length <= gamma + 1 for r in result.rounds)


@pytest.mark.parametrize("field, value", [
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")), ("temperature", -0.1),
    ("temperature", float("inf")), ("top_k", -1), ("top_k", 2.5), ("max_new_tokens", 1),
    ("verify", "Full"), ("threshold", 1.2), ("ngram_match", "first"), ("ngram_max", 0),
    ("draft_sampling", "argmax"), ("tie_tolerance", -1e-3), ("estimate_anchors", 0),
])
def test_eval_settings_refuse_what_the_recipe_section_refuses(field, value):
    """A library caller bypasses the recipe's bounds: top_p 0 gave NaN probabilities mid-run, a
    misspelt verify mode or n-gram rule silently ran the default."""
    from draftforge.errors import InputError
    from draftforge.eval.harness import EvalSettings

    with pytest.raises(InputError, match=rf"EvalSettings: {field} must be .*, got {value!r}"):
        EvalSettings(**{field: value})


def test_eval_settings_take_the_bounds_themselves():
    from draftforge.eval.harness import EvalSettings

    defaults = EvalSettings()
    assert (defaults.max_new_tokens, defaults.temperature, defaults.top_k, defaults.top_p, defaults.verify,
            defaults.threshold, defaults.draft_sampling) == (256, 0.0, 0, 1.0, "full", 0.5, "greedy")
    lows = {"max_new_tokens": 2, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "verify": "threshold",
            "threshold": 0.0, "ngram_match": "earliest", "ngram_max": 1, "tie_tolerance": 0.0,
            "estimate_anchors": 1}
    settings = EvalSettings(**lows)
    assert {field: getattr(settings, field) for field in lows} == lows
    highs = {"temperature": 1, "top_p": 1e-6, "threshold": 1, "draft_sampling": "sample"}
    settings = EvalSettings(**highs)
    assert {field: getattr(settings, field) for field in highs} == highs
