"""Round 44: calibrate's holdout_every is checked; eval compare's pairing and the per-position
acceptance are checked against hand computations."""

from __future__ import annotations

import json
import re

import pytest

from draftforge.eval.calibration import calibrate
from draftforge.eval.harness import WorkloadResult, summarize
from draftforge.eval.report import markdown_table
from draftforge.eval.speculative import DecodeResult, Round

# --------------------------------------------------------------------------- calibrate(holdout_every)


def _samples(count: int) -> list[tuple[int, float, float]]:
    return [(0, 0.5 * (i % 5) - 1.0, float(i % 3 != 0)) for i in range(count)]


@pytest.mark.parametrize("holdout_every", [0, 1, -1, -3])
@pytest.mark.parametrize("with_prompts", [False, True])
def test_calibrate_refuses_holdout_every_below_two(holdout_every, with_prompts):
    # 0 divided by zero (ZeroDivisionError), 1 held out every sample and fitted on none, a
    # negative value held out none (n % -k is never -k - 1): each silently or obscurely wrong
    samples = _samples(12)
    prompt_ids = [("w", i) for i in range(12)] if with_prompts else None
    with pytest.raises(ValueError, match=rf"holdout_every must be a whole number >= 2 .*got {holdout_every}$"):
        calibrate(samples, 1, holdout_every=holdout_every, prompt_ids=prompt_ids)


def test_calibrate_holds_out_every_holdout_every_th_sample():
    # 12 samples at position 0, holdout_every 3: indices 2, 5, 8, 11 held out, 8 fitted
    result = calibrate(_samples(12), 1, holdout_every=3)
    assert result["held_out_samples"] == [4] and result["fit_samples"] == [8]
    # by prompt: prompts 0..5 each give two samples; prompts 2 and 5 are held out
    prompt_ids = [("w", i // 2) for i in range(12)]
    result = calibrate(_samples(12), 1, holdout_every=3, prompt_ids=prompt_ids)
    assert result["held_out_samples"] == [4] and result["fit_samples"] == [8]


# --------------------------------------------------------------------------- eval compare pairing


def _workload(rounds, sums, digest="abc", methods=("dspark", "ngram")):
    return {"num_prompts": len(rounds), "prompt_digest": digest,
            "methods": {m: {"prompt_rounds": list(rounds), "prompt_al_sum": list(sums)} for m in methods}}  # fmt: skip


def _report(folder, workloads):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps({"workloads": workloads}))
    return folder / "report.json"


FIVE = ([4, 3, 5, 2, 6], [6.0, 4.5, 7.5, 3.0, 9.0])  # AL 1.5 on every prompt


@pytest.mark.parametrize(
    ("b_workloads", "named"),
    [
        ({"w": _workload(*FIVE), "v": _workload(*FIVE)}, r"has workloads \['w'\] but .*b/report.json has \['v', 'w'\]"),
        ({"w": _workload(*FIVE, digest="xyz")}, r"measured on different prompts \(5 prompts, digest abc against 5, xyz\)"),
        ({"w": _workload(FIVE[0][:4], FIVE[1][:4])}, r"different prompts \(5 prompts, digest abc against 4, abc\)"),
        ({"w": _workload(*FIVE, methods=("ngram",))}, r"b/report.json: workload 'w' has no method 'dspark'"),
    ],
)  # fmt: skip
def test_compare_refuses_reports_it_cannot_pair(tmp_path, capsys, b_workloads, named):
    from draftforge.cli import main

    a = _report(tmp_path / "a", {"w": _workload(*FIVE)})
    b = _report(tmp_path / "b", b_workloads)
    assert main(["eval", "compare", str(a), str(b), "--draws", "200"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert re.search(named, captured.err)


def test_compare_pairs_a_prompt_without_rounds_by_its_index(tmp_path, capsys):
    from draftforge.cli import main

    # A's prompt 1 ended at its first token (no round): A pools 24 / 17, B 1.5 on every prompt
    a = _report(tmp_path / "a", {"w": _workload([4, 0, 5, 2, 6], [6.0, 0.0, 7.0, 3.0, 8.0])})
    b = _report(tmp_path / "b", {"w": _workload(*FIVE)})
    assert main(["eval", "compare", str(a), str(b), "--draws", "2000"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    fields = dict(kv.split("=", 1) for kv in last.split())
    assert float(fields["diff_macro"]) == pytest.approx(24 / 17 - 1.5, abs=1e-4)
    assert float(fields["low"]) <= float(fields["diff_macro"]) <= float(fields["high"])
    assert "nan" not in last.lower()
    assert fields["verdict"] == "too_few_prompts"  # 4 prompts with a round, fewer than 5


# --------------------------------------------------------------------------- per-position acceptance


def _rounds(accepted, block, verified=None):
    verified = verified or [block] * len(accepted)
    return DecodeResult(prompt_len=3, tokens=[1] * sum(a + 1 for a in accepted),
                        rounds=[Round(block, v, a, a + 1) for a, v in zip(accepted, verified, strict=True)])  # fmt: skip


def _by_hand(accepted, block):
    """(#rounds accepting > k) / (#rounds accepting >= k), None where no round reached k."""
    out = []
    for k in range(block):
        reached = sum(a >= k for a in accepted)
        out.append(sum(a > k for a in accepted) / reached if reached else None)
    return out


def test_position_acceptance_and_tokens_verified_match_a_hand_computation():
    accepted = [0, 3, 8, 1]
    summary = summarize([_rounds(accepted, 8)], block_size=8)
    assert _by_hand(accepted, 8) == pytest.approx([3 / 4, 2 / 3, 1.0, 1 / 2, 1.0, 1.0, 1.0, 1.0])
    assert summary["position_acceptance"] == pytest.approx(_by_hand(accepted, 8))
    assert summary["position_reached"] == [4, 3, 2, 2, 1, 1, 1, 1]
    assert summary["tokens_verified_per_round"] == 9.0  # 8 drafts + the anchor, every round
    result = WorkloadResult("w", 1)
    result.methods["dspark"] = summary
    text = markdown_table([result], block_size=8, settings={"temperature": 0})
    assert "| w | 0.75 | 0.67 | 1.00 | 0.50 | 1.00 | 1.00 | 1.00 | 1.00 |" in text.splitlines()
    assert "| w | dspark | 4.00 | 9.00 |" in text


def test_a_position_no_round_reached_is_undefined_not_zero():
    # threshold verification: the second round verified 2 drafts and accepted both, so it
    # reached positions 0 and 1 only; the third was rejected at 2; no round reached 3
    summary = summarize([_rounds([0, 2, 2], 4, verified=[4, 2, 4])], block_size=4)
    assert summary["position_reached"] == [3, 2, 1, 0]
    assert summary["position_acceptance"] == pytest.approx([2 / 3, 1.0, 0.0, None])
    assert summary["tokens_verified_per_round"] == pytest.approx((5 + 3 + 5) / 3)
    result = WorkloadResult("w", 1)
    result.methods["dspark"] = summary
    rows = markdown_table([result], block_size=4, settings={"temperature": 0}).splitlines()
    assert "| w | 0.67 | 1.00 | 0.00 | - |" in rows
    assert not any("nan" in row.lower() for row in rows)
