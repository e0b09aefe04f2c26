"""Session 53: ``--calibrate-rule survival`` fits the temperatures as SGLang's own fitter
(``sglang.benchmark.dspark_sts_fit``, 0.5.23) does, checked against a slow reference written
here from its description: position by position, the temperature of a log-spaced grid of 41
values from 0.1 to 10 minimising the 15-bin ECE of the survival probability
prod_{i<=k} sigmoid(z_i / T_i) against 'drafts 0..k all accepted', the earlier positions at
their fitted temperatures, the first (smallest) temperature kept on a tie."""

from __future__ import annotations

import json
import math
import random

import pytest
from test_eval_cli import recipe_path  # noqa: F401  (fixture)

from draftforge.eval.calibration import calibrate_survival, round_outcomes
from draftforge.eval.speculative import Round


def _ece_slow(probs: list[float], labels: list[float], bins: int) -> float:
    total = len(probs)
    error = 0.0
    for b in range(bins):
        members = [i for i, p in enumerate(probs) if min(int(p * bins), bins - 1) == b]
        if members:
            mean_p = sum(probs[i] for i in members) / len(members)
            mean_y = sum(labels[i] for i in members) / len(members)
            error += len(members) / total * abs(mean_p - mean_y)
    return error


def _survival(z: list[float], temps: list[float], k: int) -> float:
    value = 1.0
    for i in range(k + 1):
        value *= 1.0 / (1.0 + math.exp(-z[i] / temps[i]))
    return value


def _fit_slow(rounds: list[tuple[list[float], int]], gamma: int) -> list[float]:
    grid = [10 ** (math.log10(0.1) + (math.log10(10.0) - math.log10(0.1)) * i / 40) for i in range(41)]
    temps: list[float] = []
    for k in range(gamma):
        best_t, best_e = None, None
        for t in grid:
            trial = [*temps, t]
            e = _ece_slow([_survival(z, trial, k) for z, _ in rounds], [float(a > k) for _, a in rounds], 15)
            if best_e is None or e < best_e:
                best_t, best_e = t, e
        temps.append(best_t)
    return temps


def _rounds(count: int, gamma: int, seed: int) -> list[tuple[list[float], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        z = [rng.gauss(1.0 - 0.6 * k, 2.5) for k in range(gamma)]
        accepted = 0
        while accepted < gamma and rng.random() < 1.0 / (1.0 + math.exp(-z[accepted] / 2.0)):
            accepted += 1
        out.append((z, accepted))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_survival_rule_matches_a_slow_reference_of_sglangs_fitter(seed):
    gamma = 4
    rounds = _rounds(60, gamma, seed)
    prompts = [("w", i // 3) for i in range(len(rounds))]  # 3 rounds a prompt; odd prompts held out
    fit_rows = [r for r, p in zip(rounds, prompts, strict=True) if p[1] % 2 == 0]
    held_rows = [r for r, p in zip(rounds, prompts, strict=True) if p[1] % 2 == 1]
    got = calibrate_survival(rounds, gamma, dataset="w", prompt_ids=prompts)
    expected = _fit_slow(fit_rows, gamma)
    assert got["temperatures"] == pytest.approx(expected, rel=1e-12)
    assert got["temperatures"] != [1.0] * gamma  # a fit happened
    for k in range(gamma):
        before = _ece_slow([_survival(z, [1.0] * gamma, k) for z, _ in held_rows], [float(a > k) for _, a in held_rows], 15)
        after = _ece_slow([_survival(z, expected, k) for z, _ in held_rows], [float(a > k) for _, a in held_rows], 15)
        assert got["ece_before"][k] == pytest.approx(before, abs=1e-12)
        assert got["ece_after"][k] == pytest.approx(after, abs=1e-12)
    pooled = _ece_slow([_survival(z, expected, k) for z, _ in held_rows for k in range(gamma)],
                       [float(a > k) for _, a in held_rows for k in range(gamma)], 15)
    assert got["pooled_ece_after"] == pytest.approx(pooled, abs=1e-12)
    assert got["num_samples"] == 60 and got["fit_samples"] == [len(fit_rows)] * gamma
    assert got["held_out_samples"] == [len(held_rows)] * gamma and got["rule"] == "survival"


def test_survival_rule_keeps_the_smallest_temperature_on_a_tie_and_one_without_enough_rounds():
    # every draft accepted and every logit 0: each candidate gives the same ECE at position 0
    # (sigmoid(0) = 0.5 whatever T): SGLang's strict '<' keeps the grid's first, 0.1
    rounds = [([0.0, 0.0], 2)] * 20
    got = calibrate_survival(rounds, 2)
    assert got["temperatures"][0] == pytest.approx(0.1) and got["temperature_at_bound"][0] == "lower"
    few = calibrate_survival(rounds[:7], 2)  # 4 fitting rounds of 7 (every second held out)
    assert few["temperatures"] == [1.0, 1.0] and few["temperature_at_bound"] == [None, None]


def test_round_outcomes_keeps_rounds_whose_every_draft_was_judged():
    gamma = 4
    z = [0.5, -0.5, 1.0, 2.0]
    full = Round(num_proposed=4, num_verified=4, num_accepted=4, acceptance_length=5, confidence_logits=z)
    rejected = Round(num_proposed=4, num_verified=4, num_accepted=1, acceptance_length=2, confidence_logits=z)
    # the output's end: 2 drafts sent, both accepted; the last two never judged
    cut = Round(num_proposed=2, num_verified=2, num_accepted=2, acceptance_length=3, confidence_logits=z[:2])
    # 3 sent (the budget), one rejected: the rest would be rejected too
    cut_rejected = Round(num_proposed=3, num_verified=3, num_accepted=1, acceptance_length=2, confidence_logits=z)
    # an accepted end-of-sequence at draft 1: drafts after it are not judged
    eos = Round(num_proposed=4, num_verified=2, num_accepted=2, acceptance_length=3, confidence_logits=z)
    no_head = Round(num_proposed=4, num_verified=4, num_accepted=0, acceptance_length=1)
    assert round_outcomes([full, rejected, cut, cut_rejected, eos, no_head], gamma) == [
        (z, 4), (z, 1), (z, 1)]


def test_eval_cli_writes_sglangs_rule_and_refuses_the_rule_without_calibrate(recipe_path, tmp_path, capsys):  # noqa: F811
    from eval_helpers import random_prompts
    from test_eval_cli import _tiny_export_and_prompts

    from draftforge.cli import main

    export_dir, prompts = _tiny_export_and_prompts(recipe_path, tmp_path)
    prompts.write_text("".join(json.dumps({"workload": "w", "input_ids": ids}) + "\n" for ids in random_prompts(4)))
    sts, out = tmp_path / "sts.json", tmp_path / "r"
    common = ["eval", str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
              "--max-new-tokens", "12", "--baselines", "none", "--no-estimate", "--out", str(out)]
    assert main([*common, "--calibrate-rule", "survival"]) == 2
    assert "--calibrate-rule survival without --calibrate" in capsys.readouterr().err
    assert main([*common, "--calibrate", str(sts), "--calibrate-rule", "survival"]) == 0
    written = json.loads(sts.read_text())
    report = json.loads((out / "report.json").read_text())["calibration"]
    assert report["rule"] == "survival" and written["rule"] == "survival"
    assert written["temperatures"] == report["temperatures"] and len(written["temperatures"]) == 4
    assert {"temperatures", "ece_before", "ece_after", "dataset", "num_samples"} <= set(written)
    assert report["held_out_samples"][0] > 0
    assert "by SGLang's rule" in (out / "report.md").read_text()


def test_survival_rule_writes_no_nan_into_sglangs_file():
    """A review of this change: with no held-out round the pooled ECE is NaN, which json wrote
    as NaN into the file SGLang reads (JSON has no NaN); the pooled figures are report.json's."""
    from draftforge.eval.calibration import calibration_json

    rounds = _rounds(20, 3, 0)
    got = calibrate_survival(rounds, 3, prompt_ids=[("w", 0)] * 20)  # every round fitted, none held out
    assert math.isnan(got["pooled_ece_before"])
    text = calibration_json(got)
    assert "NaN" not in text and "pooled_ece" not in text
    written = json.loads(text)
    assert written["ece_before"] == [] and written["temperatures"] == got["temperatures"]


def test_survival_rule_refuses_non_finite_logits_and_a_bad_holdout_as_the_conditional_rule_does():
    from draftforge.errors import InputError

    rounds = _rounds(20, 3, 0)
    rounds[4] = ([rounds[4][0][0], float("nan"), rounds[4][0][2]], rounds[4][1])
    with pytest.raises(InputError, match=r"1 non-finite logits \(NaN or inf\) of 60 \(1 at position 1\)"):
        calibrate_survival(rounds, 3)
    with pytest.raises(ValueError, match="holdout_every must be a whole number >= 2"):
        calibrate_survival(_rounds(20, 3, 0), 3, holdout_every=1)
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] must be a \(workload, prompt index >= 0\) pair"):
        calibrate_survival(_rounds(2, 3, 0), 3, prompt_ids=[("w", -1), ("w", 0)])
