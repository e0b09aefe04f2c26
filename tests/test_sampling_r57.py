"""Review round 57 of sampled speculative decoding.

* ``rejection_accept`` took ``min(1.0, ratio)`` of a NaN ratio as 1.0: a target row of NaN let
  the draft through silently, where plain sampling fails. It is refused now.
* Each prompt's generator was seeded ``seed * 1_000_003 + index``, whatever the workload: the
  prompts at one index of every workload drew the same stream (the same prompt decoded the
  same in two workloads), though the macro interval resamples workloads as independent. The
  seed now depends on the workload too, and is still shared by the methods of one prompt.
"""

from __future__ import annotations

import math

import pytest
import torch
from eval_helpers import random_prompts, tiny_eval_draft, tiny_target

from draftforge.eval import harness
from draftforge.eval.harness import EvalSettings, run_workload
from draftforge.eval.speculative import rejection_accept


def test_a_nan_target_row_is_refused_not_accepted():
    generator = torch.Generator().manual_seed(0)
    nan_row = [math.nan] * 4
    with pytest.raises(ValueError, match="slot 0: the target's probability of draft token 2 is nan"):
        rejection_accept([2], None, torch.tensor([nan_row, [0.1, 0.2, 0.3, 0.4]]), generator)
    draft = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]])
    with pytest.raises(ValueError, match="slot 1: .* NaN or infinite"):
        rejection_accept([1, 2], draft, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.1, 0.2, math.inf, 0.3],
                                                      [0.25] * 4]), generator)
    # finite rows: the draft with p_t = p_d is always accepted, then the bonus is drawn
    assert rejection_accept([1], torch.tensor([[0.0, 1.0, 0.0, 0.0]]),
                            torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]), generator) == (1, 2)


def _decode_seeds(monkeypatch):
    """Record (workload, the generator's seed, tokens) of every decode run_workload makes."""
    seen = []
    real = harness.speculative_decode

    def recording(session, prompt, proposer, settings, *, generator):
        seed = generator.initial_seed()
        result = real(session, prompt, proposer, settings, generator=generator)
        seen.append((seed, tuple(result.tokens)))
        return result

    monkeypatch.setattr(harness, "speculative_decode", recording)
    monkeypatch.setattr(harness, "warm_up", lambda *args, **kwargs: None)  # its decodes are untimed extras
    return seen


def test_workloads_draw_other_streams_and_the_methods_of_a_prompt_the_same(monkeypatch):
    target = tiny_target()
    draft = tiny_eval_draft(target)
    prompts = random_prompts(2)
    settings = EvalSettings(max_new_tokens=12, temperature=1.0, seed=7, estimate=False, baselines=("ngram", "none"))
    seen = _decode_seeds(monkeypatch)
    runs = {}
    for name in ("humaneval", "gsm8k", "humaneval"):
        seen.clear()
        run_workload(name, prompts, draft, target, settings, progress=lambda _: None)
        runs.setdefault(name, []).append(list(seen))
    first, again = runs["humaneval"]
    assert first == again  # reproducible
    methods = len(first) // len(prompts)
    assert methods == 3
    for index in range(len(prompts)):  # one seed for every method of a prompt
        assert len({seed for seed, _ in first[index * methods:(index + 1) * methods]}) == 1
    other = runs["gsm8k"][0]
    for index in range(len(prompts)):
        ours, theirs = first[index * methods], other[index * methods]
        assert ours[0] != theirs[0]  # the same prompt at the same index: another stream
        assert ours[1] != theirs[1]  # and (12 tokens sampled from a 512-token vocabulary) another output
    assert len({seed for seed, _ in first + other}) == 2 * len(prompts)
