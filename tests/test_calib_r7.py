"""Round 7, eval statistics: a method without any verification round (max_new_tokens 1, an
end of sequence first) and a train-time estimate slot that is never valid get no made-up
number: ``eval compare`` refuses, the report's intervals say ``-`` and ``no rounds``, and
``slot_c_star`` is undefined rather than 0."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from eval_helpers import tiny_eval_draft, tiny_target

from draftforge.errors import InputError
from draftforge.eval.uncertainty import PromptTotals, bootstrap, interval_text, report_uncertainty

ROUNDS = [4, 3, 5, 2, 6]
AL_SUM = [8.0, 5.0, 7.0, 3.0, 8.0]


def _report(folder, dspark_rounds, dspark_al_sum):
    folder.mkdir(parents=True, exist_ok=True)
    methods = {"dspark": {"prompt_rounds": dspark_rounds, "prompt_al_sum": dspark_al_sum},
               "ngram": {"prompt_rounds": ROUNDS, "prompt_al_sum": AL_SUM}}  # fmt: skip
    report = {"workloads": {"w": {"num_prompts": 5, "prompt_digest": "abc", "methods": methods}}}
    (folder / "report.json").write_text(json.dumps(report))
    return folder / "report.json"


def test_compare_refuses_a_method_that_ran_no_round(tmp_path, capsys):
    """It printed ``diff_macro=nan low=nan high=nan verdict=not_distinguishable`` and exit 0."""
    from draftforge.cli import main
    from draftforge.eval.compare import load_report, paired_totals

    empty = _report(tmp_path / "empty", [0] * 5, [0.0] * 5)
    assert main(["eval", "compare", str(empty), "--draws", "200"]) == 2
    captured = capsys.readouterr()
    assert "diff_macro" not in captured.out
    assert f"{empty}: workload 'w', method 'dspark' ran no verification round on any of its 5 prompts" in captured.err
    full = _report(tmp_path / "full", ROUNDS, AL_SUM)
    with pytest.raises(InputError, match="method 'dspark' ran no verification round"):
        paired_totals(load_report(str(full)), "dspark", load_report(str(empty)), "dspark")
    one_round = _report(tmp_path / "one", [0, 0, 0, 0, 1], [0.0, 0.0, 0.0, 0.0, 3.0])
    assert main(["eval", "compare", str(one_round), "--draws", "200"]) == 0  # one round is enough
    fields = dict(kv.split("=", 1) for kv in capsys.readouterr().out.strip().splitlines()[-1].split())
    assert float(fields["diff_macro"]) == pytest.approx(3.0 - sum(AL_SUM) / sum(ROUNDS))


def test_report_intervals_without_rounds_say_so():
    """The report's interval tables printed ``nan (nan to nan)`` and called the difference
    ``not distinguishable``."""
    from draftforge.eval.report import uncertainty_lines

    none = PromptTotals(np.zeros(5), np.zeros(5))
    some = PromptTotals(np.array(ROUNDS, dtype=float), np.array(AL_SUM))
    iv = bootstrap([(none, some)], draws=100)
    assert math.isnan(iv.value) and iv.verdict() == "no rounds"
    assert interval_text(iv.value, iv.low, iv.high, signed=True) == "-"
    assert interval_text(1.5, 1.25, 1.75) == "1.50 (1.25 to 1.75)"
    assert bootstrap([(some, some)], draws=100).verdict() == "not distinguishable"
    lines = "\n".join(uncertainty_lines(report_uncertainty({"w": {"dspark": none, "ngram": some}}, draws=100)))
    assert "nan" not in lines and "| w | - | no rounds |" in lines


def test_estimate_slot_c_star_is_undefined_where_no_slot_is_valid():
    """Outputs of 3 tokens with block 4: slots 2 and 3 are never inside the response. They
    were reported as c* = 0 (never accepted); the valid slots' mean is checked against c*
    recomputed here through the inference path (block_forward, teacher-forced draft_block)."""
    from draftforge.eval.estimate import train_time_estimate

    target = tiny_target()
    draft = tiny_eval_draft(target)
    prompt, output = [5, 17, 42, 99, 7, 250, 13], [61, 300, 8]
    est = train_time_estimate(draft, target, [(prompt, output)], max_anchors=8)
    ids = prompt + output
    features = target.features(torch.tensor([ids]))
    c_stars = {0: [], 1: []}
    with torch.no_grad():
        for p in (len(prompt), len(prompt) + 1):  # every anchor with a valid first slot
            anchor = torch.tensor([ids[p]])
            hidden = draft.block_forward(anchor, p, features.aux[:, :p])
            forced = torch.tensor(ids[p + 1 : p + 5] + [0] * (p + 5 - len(ids)))
            _, logits, _ = draft.draft_block(hidden, anchor, sample=lambda _l, k, forced=forced: forced[k : k + 1])
            for k in range(len(ids) - p - 1):
                p_draft = torch.softmax(logits[0, k].double(), -1)
                p_target = torch.softmax(draft.base_logits(features.final[0, p + k]).double(), -1)
                c_stars[k].append(float(1 - 0.5 * (p_draft - p_target).abs().sum()))
    assert est["num_blocks"] == 2
    assert est["slot_c_star"][:2] == pytest.approx([sum(c) / len(c) for c in c_stars.values()], abs=1e-4)
    assert all(math.isnan(x) for x in est["slot_c_star"][2:])


def test_calibration_holds_out_whole_prompts_when_told_which_prompt_each_sample_is_from():
    """draftforge eval passes each sample's (workload, prompt): every second prompt of each
    workload is held out whole, so no held-out round comes from a fitted prompt."""
    from draftforge.eval.calibration import calibrate

    samples, prompt_ids = [], []
    for prompt in [("w", 0), ("w", 1), ("w", 2), ("v", 0), ("v", 1)]:
        for k in range(3):
            for z in (-1.0, 0.5, 2.0):
                samples.append((k % 2, z + len(samples) / 100, float(z > 0)))
                prompt_ids.append(prompt)
    calibration = calibrate(samples, block_size=2, prompt_ids=prompt_ids)
    held_prompts = {("w", 1), ("v", 1)}  # the 2nd prompt of each workload
    want = [(s[0], s[1], s[2]) for s, p in zip(samples, prompt_ids, strict=True) if p in held_prompts]
    assert sorted(calibration["held_out"]) == sorted(want)
    assert sum(calibration["held_out_samples"]) == 18 and sum(calibration["fit_samples"]) == 27
    with pytest.raises(ValueError, match="2 prompt ids for 45 samples"):
        calibrate(samples, block_size=2, prompt_ids=prompt_ids[:2])
