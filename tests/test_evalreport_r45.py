"""Round 45, evaluation statistics and reports: checked against independent computations."""

from __future__ import annotations

from draftforge.eval.calibration import MIN_FIT_SAMPLES, calibrate
from draftforge.eval.report import calibration_lines

# --------------------------------------------------------------------------- unfitted temperatures


def test_report_says_which_temperatures_were_not_fitted():
    # position 0: 10 rounds from fitted prompts (0, 2, ...) and 10 held out; position 1: 3 fitting
    # samples, position 2: none at all. Positions 1 and 2 keep T = 1 without a fit, which
    # report.md printed as "1.000" beside the fitted one with nothing to tell them apart (and
    # their ECE unchanged "before -> after"), as if the head were calibrated there already.
    samples, prompt_ids = [], []
    for prompt in range(20):
        samples.append((0, 2.0 - 0.3 * (prompt % 7), float(prompt % 3 != 0)))
        prompt_ids.append(("w", prompt))
        if prompt in (0, 2, 4, 1):
            samples.append((1, 0.5 * prompt - 1.0, float(prompt % 2)))
            prompt_ids.append(("w", prompt))
    calibration = calibrate(samples, 3, prompt_ids=prompt_ids)
    assert calibration["fit_samples"] == [10, 3, 0]  # by hand: even prompts fit, odd held out
    assert calibration["temperatures"][1:] == [1.0, 1.0] and calibration["temperatures"][0] != 1.0
    calibration.pop("held_out")
    text = "\n".join(calibration_lines({**calibration, "path": "c.json"}))
    assert (f"Temperature not fitted, kept at 1 (fewer than {MIN_FIT_SAMPLES} fitting samples): "
            "position 1 (3 fitting samples), position 2 (0 fitting samples).") in text
    assert "position 0 (" not in text
