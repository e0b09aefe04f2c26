"""Bootstrap intervals over prompts, checked against the exact bootstrap distribution
(every resample enumerated) and hand-derived cases; ``draftforge eval compare`` on
hand-made reports."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from statistics import NormalDist

import numpy as np
import pytest

from draftforge.errors import InputError
from draftforge.eval.harness import summarize
from draftforge.eval.speculative import DecodeResult, Round
from draftforge.eval.uncertainty import PromptTotals, bootstrap, prompt_digest, report_uncertainty

A = PromptTotals(np.array([10.0, 4.0, 7.0, 2.0, 5.0]), np.array([15.0, 9.0, 8.0, 5.0, 6.0]))
B = PromptTotals(np.array([12.0, 5.0, 7.0, 3.0, 4.0]), np.array([14.0, 7.0, 9.0, 3.0, 6.0]))


# Student's t quantiles from printed tables, by degrees of freedom: 0.975 and 0.95
T_975 = {1: 12.706205, 2: 4.302653, 3: 3.182446, 4: 2.776445, 5: 2.570582, 6: 2.446912, 7: 2.364624}
T_95 = {1: 6.313752, 2: 2.919986, 3: 2.353363, 4: 2.131847, 5: 2.015048, 6: 1.943180, 7: 1.894579}


def expanded_tail(level: float, prompts: int) -> float:
    """The lower tail the expanded percentile interval reads (Hesterberg 2015): the normal tail
    below -sqrt(n / (n - 1)) times the table's t quantile with n - 1 degrees of freedom."""
    t = {0.95: T_975, 0.9: T_95}[level][prompts - 1]
    return NormalDist().cdf(-math.sqrt(prompts / (prompts - 1)) * t)


def _exact(workloads, paired: bool) -> np.ndarray:
    """Every bootstrap resample (index tuples per workload, all equally likely), by enumeration."""
    per_workload = []
    for a, b in workloads:
        n = len(a)
        values = []
        for idx in itertools.product(range(n), repeat=n):
            idx = list(idx)
            v = a.al_sum[idx].sum() / a.rounds[idx].sum()
            if paired:
                v -= b.al_sum[idx].sum() / b.rounds[idx].sum()
            values.append(v)
        per_workload.append(np.array(values))
    grid = np.meshgrid(*per_workload, indexing="ij")
    return (sum(grid) / len(workloads)).ravel()


def _assert_is_quantile(exact: np.ndarray, x: float, q: float, tol: float = 0.006) -> None:
    """x is a q-quantile of the exact distribution (up to Monte Carlo noise)."""
    assert (exact < x - 1e-12).mean() <= q + tol
    assert (exact <= x + 1e-12).mean() >= q - tol


@pytest.mark.parametrize("paired", [False, True])
def test_interval_bounds_are_quantiles_of_the_exact_bootstrap(paired):
    workloads = [(A, B if paired else None)]
    iv = bootstrap(workloads, draws=40_000, seed=1)
    exact = _exact([(A, B)], paired)
    tail = expanded_tail(0.95, 5)  # 0.00095: the 95 % interval of 5 prompts, expanded
    _assert_is_quantile(exact, iv.low, tail, tol=0.0006)
    _assert_is_quantile(exact, iv.high, 1 - tail, tol=0.0006)
    point = 43 / 28 - (39 / 31 if paired else 0.0)  # pooled by hand: sum(al_sum) / sum(rounds)
    assert iv.value == pytest.approx(point)


def test_macro_interval_resamples_each_workload_on_its_own():
    w1 = PromptTotals(np.array([3.0, 5.0, 2.0]), np.array([4.0, 9.0, 2.0]))
    w2 = PromptTotals(np.array([6.0, 1.0, 4.0]), np.array([12.0, 1.0, 5.0]))
    iv = bootstrap([(w1, None), (w2, None)], draws=40_000, seed=2)
    exact = _exact([(w1, None), (w2, None)], paired=False)
    tail = expanded_tail(0.95, 3)  # the fewer prompts of the two workloads: 3
    _assert_is_quantile(exact, iv.low, tail, tol=0.0015)
    _assert_is_quantile(exact, iv.high, 1 - tail, tol=0.0015)
    assert iv.value == pytest.approx((15 / 10 + 18 / 11) / 2)


def test_hand_derived_cases_and_verdicts():
    same_ratio = PromptTotals(np.array([3.0, 7.0, 1.0]), np.array([4.5, 10.5, 1.5]))
    iv = bootstrap([(same_ratio, None)], draws=500)
    assert (iv.value, iv.low, iv.high) == pytest.approx((1.5, 1.5, 1.5))
    zero = bootstrap([(A, A)], draws=500)
    assert (zero.value, zero.low, zero.high) == (0.0, 0.0, 0.0)
    assert zero.verdict() == "not distinguishable"
    better = PromptTotals(A.rounds, A.al_sum + A.rounds * 0.5)  # +0.5 per round on every prompt
    assert bootstrap([(better, A)], draws=500).verdict() == "ahead"
    assert bootstrap([(A, better)], draws=500).verdict() == "behind"
    assert bootstrap([(better, A)], draws=500).low == pytest.approx(0.5)  # the gap never varies
    one = PromptTotals(np.array([4.0]), np.array([8.0]))
    tiny = bootstrap([(one, PromptTotals(np.array([4.0]), np.array([4.0])))], draws=100)
    assert (tiny.low, tiny.high) == (1.0, 1.0) and tiny.verdict() == "too few prompts"
    with pytest.raises(ValueError, match="same prompts"):
        bootstrap([(A, PromptTotals(A.rounds[:3], A.al_sum[:3]))])


def test_summarize_keeps_the_per_prompt_totals_its_mean_pools():
    def result(lengths):
        return DecodeResult(prompt_len=3, tokens=[1] * sum(lengths),
                            rounds=[Round(8, 8, n - 1, n) for n in lengths])  # fmt: skip

    summary = summarize([result([1, 3, 2]), result([9]), result([2, 2])], block_size=8)
    assert summary["prompt_rounds"] == [3, 1, 2] and summary["prompt_al_sum"] == [6, 9, 4]
    totals = PromptTotals.from_summary(summary, "w/dspark")
    assert totals.pooled() == pytest.approx(summary["acceptance_length"]) == 19 / 6


def test_report_uncertainty_pairs_the_reference_with_each_baseline():
    u = report_uncertainty({"w": {"dspark": A, "ngram": B}}, draws=300)
    assert set(u["acceptance_length"]) == {"dspark", "ngram"}
    assert set(u["acceptance_length"]["dspark"]) == {"w", "macro"}
    pair = u["paired"]["dspark-ngram"]["macro"]
    assert pair["value"] == pytest.approx(43 / 28 - 39 / 31)  # ahead by 0.28 on the pooled means
    # but 8.7 % of the exact bootstrap distribution of the difference lies below zero (its 2.5 %
    # quantile is -0.07): the interval straddles zero and the verdict is that it cannot tell
    exact = _exact([(A, B)], paired=True)
    assert (exact < 0).mean() == pytest.approx(0.087, abs=1e-3)
    assert np.quantile(exact, 0.025) < -0.05
    assert pair["low"] < 0 < pair["high"] and pair["verdict"] == "not distinguishable"


def _report(path, methods: dict, digest="abc", num_prompts=5):
    path.mkdir(parents=True, exist_ok=True)
    entry = {
        m: {"acceptance_length": t.pooled(), "prompt_rounds": t.rounds.tolist(),
            "prompt_al_sum": t.al_sum.tolist()}
        for m, t in methods.items()
    }  # fmt: skip
    report = {"workloads": {"w": {"num_prompts": num_prompts, "prompt_digest": digest, "methods": entry}}}
    (path / "report.json").write_text(json.dumps(report))
    return path


def test_eval_compare_prints_the_paired_difference(tmp_path, capsys):
    from draftforge.cli import main

    first = _report(tmp_path / "a", {"dspark": A, "ngram": B})
    second = _report(tmp_path / "b", {"dspark": B})
    assert main(["eval", "compare", str(first), "--draws", "2000"]) == 0  # dspark vs its own ngram
    last = capsys.readouterr().out.strip().splitlines()[-1]
    fields = dict(kv.split("=", 1) for kv in last.split())
    assert float(fields["diff_macro"]) == pytest.approx(43 / 28 - 39 / 31, abs=1e-4)
    assert float(fields["low"]) <= float(fields["diff_macro"]) <= float(fields["high"])
    assert main(["eval", "compare", str(first), str(second / "report.json"), "--draws", "2000"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == last  # the same pair, other files


def test_eval_compare_refuses_what_it_cannot_pair(tmp_path, capsys):
    from draftforge.cli import main
    from draftforge.eval.compare import load_report, paired_totals

    first = _report(tmp_path / "a", {"dspark": A})
    other = _report(tmp_path / "b", {"dspark": B}, digest="xyz")
    with pytest.raises(InputError, match="different prompts"):
        paired_totals(load_report(str(first)), "dspark", load_report(str(other)), "dspark")
    undated = _report(tmp_path / "c", {"dspark": B}, digest="")
    with pytest.raises(InputError, match=r"c/report.json records no prompt digest \(an older draftforge eval wrote it\), so nothing shows"):
        paired_totals(load_report(str(first)), "dspark", load_report(str(undated)), "dspark")
    old = tmp_path / "old"
    old.mkdir()
    (old / "report.json").write_text(json.dumps({"workloads": {"w": {
        "num_prompts": 4, "methods": {"dspark": {"acceptance_length": 1.2}, "ngram": {}}}}}))  # fmt: skip
    assert main(["eval", "compare", str(old)]) == 2
    assert "older draftforge eval" in capsys.readouterr().err
    assert main(["eval", "compare", str(first)]) == 2  # no ngram in that report
    assert "no method 'ngram'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "compare", str(first), str(first), "--level", "95"])
    assert "--level must lie strictly between 0 and 1, got 95.0" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{\n  oops")
    assert main(["eval", "compare", str(tmp_path / "bad.json"), str(first)]) == 2
    assert "line 2" in capsys.readouterr().err


def test_prompt_digest_tells_prompts_apart():
    # the first 16 hex digits of the SHA-256 of the prompts' compact JSON, written out by hand
    assert prompt_digest([[1, 2], [3]]) == hashlib.sha256(b"[[1,2],[3]]").hexdigest()[:16]
    assert prompt_digest([[1, 2, 3]]) == hashlib.sha256(b"[[1,2,3]]").hexdigest()[:16]
    assert prompt_digest([[1, 2], [3]]) != prompt_digest([[1, 2, 3]])
    assert prompt_digest([[1, 2], [3]]) != prompt_digest([[3], [1, 2]])  # the order counts
    # the same ids held as tuples or numpy arrays (as the harness holds them) digest the same
    assert prompt_digest(((1, 2), (3,))) == prompt_digest([[1, 2], [3]])
    assert prompt_digest([np.array([1, 2], dtype=np.int64), np.array([3])]) == prompt_digest([[1, 2], [3]])


def test_t_quantiles_match_the_printed_tables():
    from draftforge.eval.uncertainty import t_quantile

    for table, p in ((T_975, 0.975), (T_95, 0.95)):
        for dof, value in table.items():
            assert t_quantile(p, dof) == pytest.approx(value, abs=2e-6)
    assert t_quantile(0.975, 10_000) == pytest.approx(NormalDist().inv_cdf(0.975), abs=1e-3)


def test_the_interval_covers_the_truth_at_about_its_level_with_eight_prompts():
    """Simulated workloads of 8 prompts, each prompt 10 rounds whose mean AL is 1 + 3 x Beta(2, 5)
    (true pooled AL 1 + 6/7): the expanded 95 % interval covers the truth about 95 % of the
    time. The plain percentile interval of the same draws covered it about 89 % of the time."""
    rng = np.random.default_rng(5)
    truth = 1 + 3 * 2 / 7
    covered = plain = 0
    trials = 600
    for trial in range(trials):
        per_prompt = 1 + 3 * rng.beta(2, 5, size=8)
        totals = PromptTotals(np.full(8, 10.0), per_prompt * 10)
        iv = bootstrap([(totals, None)], draws=2000, seed=trial)
        covered += iv.low <= truth <= iv.high
        draws = rng.integers(0, 8, size=(2000, 8))
        means = per_prompt[draws].mean(axis=1)
        low, high = np.percentile(means, [2.5, 97.5])
        plain += low <= truth <= high
    assert covered / trials >= 0.925, covered / trials
    assert plain / trials < covered / trials - 0.02, (plain / trials, covered / trials)


def test_the_reports_al_table_says_which_workloads_have_too_few_prompts_for_a_spread():
    from draftforge.eval.report import uncertainty_lines

    one = PromptTotals(np.array([4.0]), np.array([7.2]))
    u = report_uncertainty({"one": {"dspark": one, "ngram": one, "none": PromptTotals(np.array([4.0]), np.array([4.0]))},
                            "five": {"dspark": A, "ngram": B, "none": A}}, draws=500)
    text = "\n".join(uncertainty_lines(u))
    assert "| one | 1.80 (1.80 to 1.80) |" in text  # zero width: one prompt
    assert "the macro interval counts no spread for them: one (1)." in text
    assert "five (" not in text
    five_only = report_uncertainty({"five": {"dspark": A, "ngram": B, "none": A}}, draws=500)
    assert "Too few prompts" not in "\n".join(uncertainty_lines(five_only))
