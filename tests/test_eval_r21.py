"""Review round 21, evaluation numerics against slow references written here: per-position
temperature scaling on held-out prompts, ECE, the paired bootstrap over prompts, the report's
means (per round, pooled over prompts) and per-position conditional acceptance, and the
train-time estimate (tau from c*, tau_greedy, tau_sampled)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from eval_helpers import tiny_eval_draft, tiny_target

from draftforge.eval.calibration import (
    calibrate,
    expected_calibration_error,
    fit_temperature,
    round_samples,
)
from draftforge.eval.harness import WorkloadResult, summarize
from draftforge.eval.speculative import DecodeResult, Round
from draftforge.eval.uncertainty import PromptTotals, bootstrap, by_workload

# --------------------------------------------------------------------------- references


def _ref_ece(probs: list[float], labels: list[float], bins: int = 10) -> float:
    """Equal-width bins [b/10, (b+1)/10), the last closed, by plain loops."""
    total, n = 0.0, len(probs)
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        members = [i for i, p in enumerate(probs) if lo <= p < hi or (b == bins - 1 and p == 1.0)]
        if members:
            conf = sum(probs[i] for i in members) / len(members)
            acc = sum(labels[i] for i in members) / len(members)
            total += len(members) / n * abs(acc - conf)
    return total


def _ref_temperature(z: list[float], y: list[float]) -> float:
    """The log-loss minimiser over a fine log-spaced grid of T in [0.05, 100]."""
    zt, yt = torch.tensor(z, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    grid = np.exp(np.linspace(math.log(0.05), math.log(100.0), 40_001))
    losses = [float(torch.nn.functional.binary_cross_entropy_with_logits(zt / t, yt)) for t in grid]
    return float(grid[int(np.argmin(losses))])


def _rounds_for(rng: np.random.Generator, n: int, gamma: int) -> list[Round]:
    rounds = []
    for _ in range(n):
        logits = rng.normal(0.0, 2.0, gamma).tolist()
        accepted = 0
        while accepted < gamma and rng.random() < 1 / (1 + math.exp(-logits[accepted] / 2.5)):
            accepted += 1
        rounds.append(Round(gamma, gamma, accepted, accepted + 1, confidence_logits=logits))
    return rounds


# --------------------------------------------------------------------------- calibration


def test_calibration_fits_each_position_on_the_fitted_prompts_and_measures_on_the_held_out():
    """Sequential temperature scaling by hand: position k's samples are the rounds that reached
    k (label: accepted at k); prompts 1, 3, ... of each workload are held out; T_k minimises the
    log loss on the other prompts' samples at k; ECE before and after on the held-out ones."""
    gamma, rng = 3, np.random.default_rng(7)
    samples, prompt_ids, by_prompt = [], [], {}
    for workload, count in (("a", 5), ("b", 4)):
        for index in range(count):
            rounds = _rounds_for(rng, 30, gamma)
            s = round_samples(rounds)
            by_prompt[(workload, index)] = rounds
            samples += s
            prompt_ids += [(workload, index)] * len(s)
    cal = calibrate(samples, gamma, prompt_ids=prompt_ids)
    for k in range(gamma):
        fit, held = [], []
        for (_workload, index), rounds in by_prompt.items():
            for r in rounds:
                if r.num_accepted >= k:  # reached k: every earlier position was accepted
                    row = (r.confidence_logits[k], 1.0 if r.num_accepted > k else 0.0)
                    (held if index % 2 == 1 else fit).append(row)
        assert cal["fit_samples"][k] == len(fit) and cal["held_out_samples"][k] == len(held)
        want = _ref_temperature([z for z, _ in fit], [y for _, y in fit])
        assert cal["temperatures"][k] == pytest.approx(want, rel=1e-3)
        probs = [1 / (1 + math.exp(-z)) for z, _ in held]
        scaled = [1 / (1 + math.exp(-z / cal["temperatures"][k])) for z, _ in held]
        assert cal["ece_before"][k] == pytest.approx(_ref_ece(probs, [y for _, y in held]), abs=1e-12)
        assert cal["ece_after"][k] == pytest.approx(_ref_ece(scaled, [y for _, y in held]), abs=1e-12)


def test_ece_by_hand_and_fit_temperature_against_a_grid():
    probs = [0.05, 0.15, 0.15, 0.95, 0.85, 1.0, 0.0, 0.12, 0.35]
    labels = [0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    # bins 0: {.05, 0}: |0 - .025| x 2;  1: {.15, .15, .12}: |2/3 - .14| x 3;  3: {.35}: .65;
    # 8: {.85}: .15;  9: {.95, 1}: .025 x 2
    by_hand = (0.05 + abs(2 / 3 - 0.14) * 3 + 0.65 + 0.15 + 0.05) / 9
    got = expected_calibration_error(torch.tensor(probs, dtype=torch.float64), torch.tensor(labels))
    assert got == pytest.approx(by_hand, abs=1e-12)
    g = torch.Generator().manual_seed(3)
    z = torch.randn(300, generator=g, dtype=torch.float64) * 4
    y = (torch.rand(300, generator=g, dtype=torch.float64) < torch.sigmoid(z / 2)).double()
    assert fit_temperature(z, y) == pytest.approx(_ref_temperature(z.tolist(), y.tolist()), rel=1e-3)


# --------------------------------------------------------------------------- bootstrap


def _slow_bootstrap(workloads, draws, level, seed):
    """The same resampled indices (one numpy generator, one draw matrix per workload in turn),
    the statistic by loops: per draw, the mean over workloads of pooled AL(a) - AL(b)."""
    rng = np.random.default_rng(seed)
    indices = [rng.integers(0, len(a), size=(draws, len(a))) for a, _ in workloads]
    values = []
    for d in range(draws):
        total = 0.0
        for (a, b), index in zip(workloads, indices, strict=True):
            rows = index[d].tolist()
            al = sum(a.al_sum[i] for i in rows) / sum(a.rounds[i] for i in rows)
            if b is not None:
                al -= sum(b.al_sum[i] for i in rows) / sum(b.rounds[i] for i in rows)
            total += al
        values.append(total / len(workloads))
    values = sorted(values)
    from test_eval_uncertainty import expanded_tail  # the expanded percentile, by a t table

    tail = expanded_tail(level, min(len(a) for a, _ in workloads))

    def quantile(q):  # linear interpolation between order statistics (numpy's default)
        h = (draws - 1) * q
        lo = math.floor(h)
        return values[lo] + (h - lo) * (values[min(lo + 1, draws - 1)] - values[lo])

    return quantile(tail), quantile(1 - tail)


def test_paired_bootstrap_against_a_slow_reference():
    a1 = PromptTotals(np.array([10.0, 4.0, 7.0, 2.0, 5.0, 9.0]), np.array([15.0, 9.0, 8.0, 5.0, 6.0, 30.0]))
    b1 = PromptTotals(np.array([12.0, 5.0, 7.0, 3.0, 4.0, 9.0]), np.array([14.0, 7.0, 9.0, 3.0, 6.0, 20.0]))
    a2 = PromptTotals(np.array([3.0, 8.0, 6.0, 5.0, 2.0]), np.array([9.0, 30.0, 10.0, 11.0, 3.0]))
    b2 = PromptTotals(np.array([4.0, 9.0, 6.0, 6.0, 2.0]), np.array([7.0, 20.0, 9.0, 9.0, 2.0]))
    for workloads in ([(a1, b1)], [(a1, None)], [(a1, b1), (a2, b2)]):
        iv = bootstrap(workloads, draws=2000, level=0.9, seed=11)
        low, high = _slow_bootstrap(workloads, 2000, 0.9, 11)
        # the tail from a 6-decimal t table moves the interpolated quantile by ~1e-8
        assert (iv.low, iv.high) == pytest.approx((low, high), abs=1e-6)
        point = sum(a.al_sum.sum() / a.rounds.sum() - (0 if b is None else b.al_sum.sum() / b.rounds.sum())
                    for a, b in workloads) / len(workloads)
        assert iv.value == pytest.approx(point, abs=1e-12)
    # the same seed repeats the interval, another seed moves it; pairing narrows it here
    assert bootstrap([(a1, b1)], draws=2000, seed=11) == bootstrap([(a1, b1)], draws=2000, seed=11)
    assert bootstrap([(a1, b1)], draws=2000, seed=12).low != bootstrap([(a1, b1)], draws=2000, seed=11).low
    per = by_workload({"one": (a1, b1), "two": (a2, b2)}, draws=2000, seed=11)
    assert set(per) == {"one", "two", "macro"}


# --------------------------------------------------------------------------- report means


def _decoded(acceptance: list[int], gamma: int = 4) -> DecodeResult:
    rounds = [Round(gamma, gamma, al - 1, al) for al in acceptance]
    return DecodeResult(prompt_len=3, tokens=[1] * (1 + sum(acceptance)), rounds=rounds, wall_s=1.0)


def test_acceptance_length_is_the_mean_per_round_pooled_over_prompts_and_per_position_is_conditional():
    # prompt 0: rounds 5, 5, 5, 1; prompt 1: one round of 2. Per round, pooled: 18 / 5 = 3.6;
    # the mean of per-prompt means would be (4 + 2) / 2 = 3.
    summary = summarize([_decoded([5, 5, 5, 1]), _decoded([2])], 4)
    assert summary["acceptance_length"] == pytest.approx(3.6)
    assert PromptTotals.from_summary(summary, "w").pooled() == pytest.approx(3.6)
    # reached / accepted by position: k=0: 5 rounds, 4 accepted; k=1: 4, 3; k=2: 3, 3; k=3: 3, 3
    assert summary["position_reached"] == [5, 4, 3, 3]
    assert summary["position_acceptance"] == pytest.approx([4 / 5, 3 / 4, 1.0, 1.0])


def test_report_says_the_acceptance_length_is_per_round_pooled_over_prompts():
    from draftforge.eval.report import markdown_table

    result = WorkloadResult("gsm8k", 2)
    result.methods["dspark"] = summarize([_decoded([5, 5, 5, 1]), _decoded([2])], 4)
    result.methods["none"] = summarize([_decoded([1] * 5), _decoded([1] * 3)], 4)
    text = markdown_table([result], block_size=4, settings={"temperature": 0})
    assert "| gsm8k | dspark | 3.60 |" in text
    assert "mean over the workload's verification rounds" in text
    assert "not the mean of per-prompt means" in text
    assert "unweighted mean over workloads" in text


# --------------------------------------------------------------------------- train-time estimate


def _topk_probs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    probs = torch.softmax(logits.double() / temperature, -1)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[probs.topk(top_k).indices] = True
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum()


@pytest.mark.parametrize("draft_sampling", ["greedy", "sample"])
def test_train_time_estimate_against_a_slow_reference(draft_sampling):
    """Every response position with a next token is an anchor (max_anchors above their count):
    tau = mean over anchors of 1 + sum_k prod_{i<=k} c*_i with c* = 1 - 0.5 |p_d - p_t|_1 on the
    slots inside the response; tau_greedy the mean teacher-forced greedy run (up to an accepted
    end of sequence, without the bonus); tau_sampled with the sampling rule's acceptance, an
    end of sequence accepting nothing."""
    from draftforge.eval.estimate import train_time_estimate

    target = tiny_target()
    draft = tiny_eval_draft(target)
    prompt = [5, 17, 42, 99, 7, 250, 13]
    ids = prompt + [61, 300, 8, 77, 401, 9]
    features = target.features(torch.tensor([ids]))
    gamma, temperature, top_k = draft.config.block_size, 0.7, 20
    anchors = range(len(prompt), len(ids) - 1)
    taus, greedy, sampled, eos = [], [], [], None
    with torch.no_grad():
        runs = {}
        for p in anchors:
            truth = ids[p + 1 : p + 1 + gamma]
            anchor = torch.tensor([ids[p]])
            hidden = draft.block_forward(anchor, p, features.aux[:, :p])
            forced = torch.tensor(truth + [0] * (gamma - len(truth)))
            _, logits, _ = draft.draft_block(hidden, anchor, sample=lambda _l, k, forced=forced: forced[k : k + 1])
            runs[p] = (truth, logits[0, : len(truth)])
        # an end of sequence the draft predicts somewhere inside a block, so that it matters
        eos = int(runs[len(prompt)][1][1].argmax())
        for p, (truth, logits) in runs.items():
            c_star, prod, tau = [], 1.0, 1.0
            run, stopped = 1, False
            s_prod, s_tau = 1.0, 1.0
            for k in range(len(truth)):
                target_logits = draft.base_logits(features.final[0, p + k])
                p_d, p_t = torch.softmax(logits[k].double(), -1), torch.softmax(target_logits.double(), -1)
                c_star.append(float(1 - 0.5 * (p_d - p_t).abs().sum()))
                prod *= max(0.0, min(1.0, c_star[-1]))
                tau += prod
                guess = int(logits[k].argmax())
                if not stopped:
                    if guess == truth[k]:
                        run += 1
                        if truth[k] == eos:  # accepted end of sequence: counts, no bonus
                            run -= 1
                            stopped = True
                    else:
                        stopped = True
                pi_t = _topk_probs(target_logits, temperature, top_k)
                if draft_sampling == "greedy":
                    accept = 0.0 if guess == eos else float(pi_t[guess])
                else:
                    both = torch.minimum(pi_t, _topk_probs(logits[k], temperature, top_k))
                    accept = float(both.sum() - both[eos])
                s_prod *= accept
                s_tau += s_prod
            taus.append(tau)
            greedy.append(run)
            sampled.append(s_tau)
    est = train_time_estimate(draft, target, [(prompt, ids[len(prompt):])], max_anchors=64, temperature=temperature,
                              top_k=top_k, draft_sampling=draft_sampling, eos_token_ids=[eos])
    assert est["num_blocks"] == len(anchors)
    assert est["tau"] == pytest.approx(sum(taus) / len(taus), abs=1e-4)
    assert est["tau_greedy"] == pytest.approx(sum(greedy) / len(greedy))
    assert est["tau_sampled"] == pytest.approx(sum(sampled) / len(sampled), abs=1e-4)


def test_estimate_note_does_not_promise_measured_greedy_al_below_tau():
    """c* and the greedy rule order either way: p_t = (0.6, 0.4), p_d = (0.9, 0.1) give
    c* = 1 - 0.5 (0.3 + 0.3) = 0.7 while greedy verification accepts (both argmax 0); with
    p_t = (0.51, 0.49), p_d = (0.49, 0.51) c* = 0.98 while greedy rejects. The note said
    "expect measured AL below tau" whatever the rule; it now names the rule's own estimate."""
    from draftforge.eval.report import ESTIMATE_NOTE

    for p_t, p_d, greedy in (([0.6, 0.4], [0.9, 0.1], 1.0), ([0.51, 0.49], [0.49, 0.51], 0.0)):
        c_star = 1 - 0.5 * sum(abs(t - d) for t, d in zip(p_t, p_d, strict=True))
        assert (greedy > c_star) == (greedy == 1.0)
    assert "expect measured AL below tau" not in ESTIMATE_NOTE
    assert "at or below the estimate of the rule this run verified with" in ESTIMATE_NOTE
    assert "tau can lie on either side of the measured AL" in ESTIMATE_NOTE


def test_eval_compare_with_defaults_reproduces_the_reports_own_paired_interval(tmp_path, capsys):
    """The report's dspark-minus-ngram macro interval and `eval compare REPORT` (the same draws,
    level and seed) are one computation: the same numbers, to the printed digits."""
    import json

    from draftforge.cli import main
    from draftforge.eval.report import _jsonable, report_dict

    rng = np.random.default_rng(5)
    results = []
    for name in ("gsm8k", "mbpp"):
        result = WorkloadResult(name, 6, prompt_digest=name)
        for method, top in (("dspark", 5), ("ngram", 3)):
            result.methods[method] = summarize(
                [_decoded(rng.integers(1, top + 1, rng.integers(1, 9)).tolist()) for _ in range(6)], 4)
        results.append(result)
    report = report_dict(results, {"command": "c"})
    (tmp_path / "report.json").write_text(json.dumps(_jsonable(report)))
    assert main(["eval", "compare", str(tmp_path)]) == 0
    fields = dict(kv.split("=", 1) for kv in capsys.readouterr().out.strip().splitlines()[-1].split())
    macro = report["uncertainty"]["paired"]["dspark-ngram"]["macro"]
    for key in ("value", "low", "high"):
        assert float(fields["diff_macro" if key == "value" else key]) == pytest.approx(macro[key], abs=1e-4)
    assert fields["verdict"] == macro["verdict"].replace(" ", "_")


def test_eval_compare_names_a_num_prompts_that_is_no_count(tmp_path, capsys):
    """A hand-edited num_prompts of "5" (a string) was reported as 'prompt_rounds holds 5 prompts
    but the workload's num_prompts is 5': the refusal now names the key and shows the value."""
    import json

    from draftforge.cli import main

    methods = {m: {"prompt_rounds": [4, 3, 5, 2, 6], "prompt_al_sum": [8, 5, 7, 3, 8]} for m in ("dspark", "ngram")}
    report = {"workloads": {"w": {"num_prompts": "5", "prompt_digest": "abc", "methods": methods}}}
    (tmp_path / "report.json").write_text(json.dumps(report))
    assert main(["eval", "compare", str(tmp_path), "--draws", "200"]) == 2
    err = capsys.readouterr().err
    assert "workloads.w.num_prompts must be a whole number of prompts, got '5'" in err
