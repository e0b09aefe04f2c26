"""Review round 11 of the speculative-decoding verifier and its statistics: damaged per-prompt
totals in a report, the lossless check's message for a token outside plain decoding's
candidates, and the train-time estimate's greedy runs at an accepted end of sequence."""

from __future__ import annotations

import json

import pytest

from draftforge.errors import InputError
from draftforge.eval.uncertainty import PromptTotals

ROUNDS = [4, 3, 5, 2, 6]
AL_SUM = [8, 5, 7, 3, 8]


def _report(folder, dspark: dict) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    methods = {"dspark": dspark, "ngram": {"prompt_rounds": ROUNDS, "prompt_al_sum": AL_SUM}}
    report = {"workloads": {"w": {"num_prompts": 5, "prompt_digest": "abc", "methods": methods}}}
    (folder / "report.json").write_text(json.dumps(report))
    return str(folder / "report.json")


@pytest.mark.parametrize(
    ("dspark", "message"),
    [
        ({"prompt_rounds": 5, "prompt_al_sum": AL_SUM}, "prompt_rounds must be a list of counts, one per prompt, got int"),
        ({"prompt_rounds": ROUNDS, "prompt_al_sum": [8, "5", 7, 3, 8]}, r"prompt_al_sum\[1\] must be a count"),
        ({"prompt_rounds": [[4], 3, 5, 2, 6], "prompt_al_sum": AL_SUM}, r"prompt_rounds\[0\] must be a count"),
        ({"prompt_rounds": [4, -3, 5, 2, 6], "prompt_al_sum": AL_SUM}, r"prompt_rounds\[1\] must be a count .* got -3"),
        ({"prompt_rounds": ROUNDS, "prompt_al_sum": [8, 5, 7, 1, 8]},
         "prompt 3: prompt_al_sum 1 is below prompt_rounds 2"),
        ("broken", "a method's entry must be a table, got str"),
    ],
)
def test_compare_refuses_damaged_per_prompt_totals_naming_the_key(tmp_path, capsys, dspark, message):
    """A string or a list where counts belong ended ``eval compare`` in a numpy traceback; a
    nested list, a negative count or fewer accepted tokens than rounds gave an acceptance
    length and a verdict as if the report were sound."""
    from draftforge.cli import main

    path = _report(tmp_path, dspark)
    with pytest.raises(InputError, match=message):
        PromptTotals.from_summary(dspark, "r: w/dspark")
    assert main(["eval", "compare", path, "--draws", "50"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: w/dspark: " in err and "Traceback" not in err


def test_sound_totals_still_load_and_pool():
    totals = PromptTotals.from_summary({"prompt_rounds": ROUNDS, "prompt_al_sum": [8.0, 5, 7, 3, 8]}, "r")
    assert totals.pooled() == pytest.approx(31 / 20)
    assert PromptTotals.from_summary({"prompt_rounds": [0, 2], "prompt_al_sum": [0, 2]}, "r").pooled() == 1.0


# ----------------------------------------------------------------------------- the estimate's runs at an EOS

EOS = 99
PROMPT = [11, 12, 13, EOS, 14, 15, 16, 17]
OUTPUT = [18, 19, 11, 12, 13, EOS]  # ends at the end of sequence, after repeating the prompt's span


def test_accepted_run_stops_at_an_accepted_end_of_sequence_without_the_bonus():
    """Decoding counts a round whose accepted drafts reach the EOS up to it, without the
    bonus (DeepSpec's rule, ``speculative_decode``); the estimate's greedy run added the bonus."""
    from draftforge.eval.estimate import accepted_run

    assert accepted_run([13, EOS, 14], [13, EOS], {EOS}) == 2
    assert accepted_run([EOS, 14], [EOS], {EOS}) == 1
    assert accepted_run([13, 7], [13, EOS], {EOS}) == 2  # rejected before the EOS: the bonus counts
    assert accepted_run([13, EOS, 14], [13, EOS]) == 3  # no end of sequence named: as before


@pytest.fixture(scope="module")
def models():
    from eval_helpers import tiny_eval_draft, tiny_target

    target = tiny_target()
    return target, tiny_eval_draft(target)


def test_the_lookup_runs_of_the_estimate_count_an_accepted_eos_as_decoding_does(models):
    """At the anchors holding 11, 12 and 13 of the output, prompt lookup copies the prompt's
    continuation ``12 13 EOS``, ``13 EOS``, ``EOS`` (then the prompt goes on), which the output
    matches up to its end of sequence: decoding counts 3, 2 and 1 there (up to the EOS, no
    bonus); the estimate said 4, 3 and 2. The anchors on 18 and 19 find no earlier match."""
    from draftforge.eval.estimate import train_time_estimate

    target, draft = models
    assert draft.config.block_size == 4
    est = train_time_estimate(draft, target, [(PROMPT, OUTPUT)], max_anchors=64, eos_token_ids=(EOS,))
    assert est["num_blocks"] == 5 and est["lookup_share"] == pytest.approx(3 / 5)
    assert est["ngram_run_at_lookup"] == pytest.approx((3 + 2 + 1) / 3)
    before = train_time_estimate(draft, target, [(PROMPT, OUTPUT)], max_anchors=64)
    assert before["ngram_run_at_lookup"] == pytest.approx((4 + 3 + 2) / 3)


def test_run_workload_hands_the_estimate_its_end_of_sequence_tokens(models, monkeypatch):
    from draftforge.eval import harness

    target, draft = models
    seen = {}
    real = harness.train_time_estimate

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(harness, "train_time_estimate", spy)
    settings = harness.EvalSettings(max_new_tokens=4, baselines=("none",), estimate_anchors=2)
    harness.run_workload("w", [PROMPT], draft, target, settings, eos_token_ids=(EOS, 7), progress=lambda _: None)
    assert tuple(seen["eos_token_ids"]) == (EOS, 7)


# ----------------------------------------------------------------------------- the lossless check's message


def test_a_token_outside_the_recorded_candidates_is_reported_below_the_last_of_them():
    """The message said the speculative token lay "at least inf below" plain decoding's choice;
    it lies at least as far below as the last of the 8 candidates plain decoding recorded."""
    from draftforge.eval.speculative import DecodeResult, LosslessCheckError, check_lossless

    gaps = {7: 0.0, 1: 1e-4} | {t: 0.25 + 0.05 * (t - 10) for t in range(10, 16)}  # the last: 0.5
    reference = DecodeResult(prompt_len=1, tokens=[3, 7], top2_margins=[9.0, 1e-4], top_gaps=[{3: 0.0}, gaps])
    with pytest.raises(LosslessCheckError) as caught:
        check_lossless(DecodeResult(prompt_len=1, tokens=[3, 99]), reference, tie_tolerance=0.1, label="w")
    message = str(caught.value)
    assert "inf" not in message
    assert ("output token 1 is 99 but plain greedy decoding gives 7 (reference top-2 logit margin there: "
            "0.0001, the speculative token outside the reference's 8 most likely tokens, at least 0.5 below "
            "its choice)") in message
    # a recorded candidate keeps its own distance
    with pytest.raises(LosslessCheckError, match=r"the speculative token at least 0\.25 below the reference's\)"):
        check_lossless(DecodeResult(prompt_len=1, tokens=[3, 10]), reference, tie_tolerance=0.1)
