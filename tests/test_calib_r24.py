"""Review round 24, calibration and evaluation statistics: bootstrap draws without any
verification round are counted, not dropped silently."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from draftforge.eval.uncertainty import PromptTotals, bootstrap

# --------------------------------------------------------------------------- bootstrap

SOME = PromptTotals(np.array([2.0, 0.0, 0.0, 0.0, 0.0]), np.array([6.0, 0.0, 0.0, 0.0, 0.0]))
ALL = PromptTotals(np.array([4.0, 3.0, 5.0, 2.0, 6.0]), np.array([8.0, 5.0, 7.0, 3.0, 8.0]))


def test_bootstrap_counts_the_draws_without_a_round():
    """Only prompt 0 of a ran a round: a draw that never resampled it has no AL(a). Such draws
    were dropped by nanpercentile without a word; the interval now counts them, and its bounds
    are the percentiles of the other draws, by loops over the same resampled indices."""
    draws, seed = 3000, 5
    iv = bootstrap([(SOME, ALL)], draws=draws, seed=seed)
    index = np.random.default_rng(seed).integers(0, 5, size=(draws, 5))
    kept = []
    for row in index.tolist():
        if 0 in row:  # AL(a) is 3 whenever prompt 0 is drawn
            kept.append(3.0 - sum(ALL.al_sum[i] for i in row) / sum(ALL.rounds[i] for i in row))
    assert iv.dropped == draws - len(kept)
    assert iv.dropped / draws == pytest.approx((4 / 5) ** 5, abs=0.03)  # no prompt 0 in 5 draws
    assert (iv.low, iv.high) == pytest.approx(tuple(np.percentile(kept, [2.5, 97.5])), abs=1e-12)
    assert iv.as_dict()["dropped"] == iv.dropped
    assert bootstrap([(ALL, ALL)], draws=200).dropped == 0


def test_compare_says_how_many_draws_it_left_out(tmp_path, capsys):
    from draftforge.cli import main

    methods = {name: {"prompt_rounds": t.rounds.tolist(), "prompt_al_sum": t.al_sum.tolist()}
               for name, t in (("dspark", SOME), ("ngram", ALL))}  # fmt: skip
    report = {"workloads": {"w": {"num_prompts": 5, "prompt_digest": "abc", "methods": methods}}}
    (tmp_path / "report.json").write_text(json.dumps(report))
    assert main(["eval", "compare", str(tmp_path), "--draws", "2000", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    dropped = bootstrap([(SOME, ALL)], draws=2000, seed=3).dropped
    assert dropped > 0
    assert (
        f"note: w: {dropped:,} of 2,000 draws resampled only prompts on which A or B ran no" in out
    )
    assert f"note: macro: {dropped:,} of 2,000 draws" in out
    assert out.strip().splitlines()[-1].startswith("diff_macro=")  # the documented last line


# --------------------------------------------------------------------------- markov init

FEW_TOKENS = [[1, 2, 3, 1, 3, 2, 1, 2, 2, 3, 3, 1]]  # 3 previous x 3 next tokens


def test_bigram_over_fewer_tokens_than_the_rank_keeps_only_the_table_s_true_rank():
    """Row-centring makes a 3 x 3 table rank 2 (each row sums to zero). The head was given
    rank 3 (the table's shape): its third columns in W1 and W2 both held ~1e-8 (the SVD's
    zero singular value), a pair too small to give each other a gradient, and the log said
    "rank-3". Now W1's third column keeps the seeded init and W2's is zero, as the docstring
    says of a table whose rank is below the head's."""
    import torch
    from dspark_helpers import tiny_draft

    from draftforge.train.markov_init import bigram_scores, init_markov_bigram

    rows, cols, scores = bigram_scores(FEW_TOKENS)
    assert scores.shape == (3, 3) and int(torch.linalg.matrix_rank(scores)) == 2
    model, fresh = tiny_draft(markov_rank=8), tiny_draft(markov_rank=8)
    message = init_markov_bigram(model, FEW_TOKENS)
    assert "rank-2 bigram" in message
    w1, w2 = model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight
    assert torch.equal(w1[:, 2:], fresh.markov_head.markov_w1.weight[:, 2:])
    assert torch.count_nonzero(w2[:, 2:]) == 0
    u, s, vh = torch.linalg.svd(scores)
    best = (u[:, :2] * s[:2]) @ vh[:2]  # the table itself (rank 2), independently
    torch.testing.assert_close(best, scores, atol=1e-12, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close((w1[rows] @ w2[cols].T).double(), scores, atol=1e-5, rtol=0)


def test_verdict_counts_only_the_prompts_with_a_round():
    """Five of six prompts ended at their first token (no round, in both methods, as greedy
    decoding makes them): every resample that has a round holds copies of prompt 0 alone, so
    the difference never varies (3 - 2 = 1 on each such draw) and the interval has zero width.
    That was called "ahead" on the strength of 6 prompts; it rests on one."""
    a = PromptTotals(np.array([3.0, 0, 0, 0, 0, 0]), np.array([9.0, 0, 0, 0, 0, 0]))
    b = PromptTotals(np.array([3.0, 0, 0, 0, 0, 0]), np.array([6.0, 0, 0, 0, 0, 0]))
    iv = bootstrap([(a, b)], draws=500)
    assert (iv.value, iv.low, iv.high) == (1.0, 1.0, 1.0)
    assert iv.prompts == 1 and iv.verdict() == "too few prompts"
    assert bootstrap([(ALL, SOME)], draws=500).prompts == 1  # the method with fewer rounds counts
    assert bootstrap([(ALL, ALL)], draws=500).prompts == 5


# --------------------------------------------------------------------------- calibration


def test_calibration_refuses_non_finite_confidence_logits():
    """A diverged draft whose confidence head gives NaN: the fit's slope was NaN, so every
    position got T = 100 (the upper bound), and NaN probabilities fell in no ECE bin, so
    ECE read 0 before and after: a broken head written out as perfectly calibrated."""
    from draftforge.errors import InputError
    from draftforge.eval.calibration import calibrate

    rng = np.random.default_rng(0)
    samples = [
        (k, float(z), float(rng.random() < 0.5)) for k in range(2) for z in rng.normal(0, 2, 40)
    ]
    finite = calibrate(samples, 2)
    assert (
        all(0.05 <= t <= 100 for t in finite["temperatures"])
        and min(finite["held_out_samples"]) == 20
    )
    broken = [(k, math.nan if k == 1 else z, y) for k, z, y in samples]
    broken[0] = (0, math.inf, 1.0)
    with pytest.raises(
        InputError,
        match=r"41 non-finite logits \(NaN or inf\) of 80 \(1 at position 0, "
        r"40 at position 1\).*diverged training",
    ):
        calibrate(broken, 2)
