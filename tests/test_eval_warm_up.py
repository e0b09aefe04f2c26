"""The evaluator's untimed warm-up: one short decode per method before a workload's first
prompt, so that one-off costs of the first forward passes are not charged to whichever method
decodes first, and nothing of it reaches the counted decodes."""

from __future__ import annotations

from dataclasses import asdict

import pytest
from eval_helpers import random_prompts
from test_eval_r13 import QUIET, draft, target  # noqa: F401  (fixtures)

import draftforge.eval.harness as harness
from draftforge.eval.harness import EvalSettings, run_workload


def _counted(result) -> dict:
    """Everything a workload reports but its times."""
    return {method: {k: v for k, v in summary.items() if k not in ("wall_s", "tokens_per_s")}
            for method, summary in result.methods.items()}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_warm_up_decodes_each_method_briefly_first_and_changes_no_count(
        target, draft, temperature, monkeypatch):  # noqa: F811
    calls = []
    decode = harness.speculative_decode

    def recording(session, prompt, proposer, settings, **kwargs):
        calls.append((proposer.name, settings.max_new_tokens))
        return decode(session, prompt, proposer, settings, **kwargs)

    monkeypatch.setattr(harness, "speculative_decode", recording)
    prompts = random_prompts(2)
    settings = EvalSettings(max_new_tokens=24, temperature=temperature, estimate=False,
                            baselines=["ngram", "none"])
    warm = run_workload("w", prompts, draft, target, settings, **QUIET)
    gamma = draft.config.block_size
    short = 2 * (gamma + 1)
    # the three methods decode the first prompt briefly, then every prompt in full
    assert calls[:3] == [("none", short), ("dspark", short), ("ngram", short)]
    assert calls[3:] == [(m, 24) for _ in prompts for m in ("none", "dspark", "ngram")]

    calls.clear()
    monkeypatch.setattr(harness, "warm_up", lambda *args: None)
    cold = run_workload("w", prompts, draft, target, settings, **QUIET)
    assert len(calls) == 6
    assert _counted(warm) == _counted(cold)  # tokens, rounds and acceptance exactly the same
    assert asdict(warm)["near_ties"] == asdict(cold)["near_ties"]
    assert warm.confidence_samples == cold.confidence_samples
