"""Confidence calibration: per-position temperatures, ECE, SGLang's JSON fields."""

from __future__ import annotations

import json
import math

import pytest
import torch

from draftforge.eval import calibration
from draftforge.eval.calibration import (
    calibrate,
    expected_calibration_error,
    fit_temperature,
    pooled_ece,
    round_samples,
    write_calibration,
)
from draftforge.eval.speculative import Round


def _miscalibrated(scales, per_position=4000, seed=0):
    """Samples whose true acceptance probability is sigmoid(z_true); the head reports z_true * scale_k."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for k, scale in enumerate(scales):
        z_true = torch.randn(per_position, generator=gen) * 1.5
        labels = (torch.rand(per_position, generator=gen) < torch.sigmoid(z_true)).float()
        samples += [(k, float(z * scale), float(y)) for z, y in zip(z_true, labels, strict=True)]
    return samples


def test_fit_temperature_recovers_the_scale():
    samples = _miscalibrated([3.0], per_position=20000)
    z = torch.tensor([s[1] for s in samples])
    y = torch.tensor([s[2] for s in samples])
    assert fit_temperature(z, y) == pytest.approx(3.0, rel=0.08)


def _log_losses(z, y, temperatures):
    """The mean log loss of sigmoid(z / T) for each T of a 1-D tensor (one row per T)."""
    s = torch.sigmoid(z[None, :] / temperatures[:, None]).clamp(1e-300, 1 - 1e-16)
    return -(y * s.log() + (1 - y) * (1 - s).log()).mean(dim=1)


def _log_loss(z, y, temperature):
    return float(_log_losses(z, y, torch.tensor([float(temperature)], dtype=torch.float64))[0])


def test_fit_temperature_finds_the_grid_minimum_and_saturated_logits_reach_the_bound():
    """Against a brute-force search over 3,000 temperatures. Saturated logits (|z| = 40, half
    of them wrong) have a vanishing curvature at T = 1 but a large slope: Newton's step used to
    stop there and keep T = 1, at a log loss of 19 instead of 0.71."""
    grid = torch.logspace(math.log10(0.05), 2, 3000, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        scale, true_t = float(torch.rand(1, generator=gen)) * 20, float(torch.rand(1, generator=gen)) * 5 + 0.1
        z = torch.randn(120, generator=gen, dtype=torch.float64) * scale
        y = (torch.rand(120, generator=gen, dtype=torch.float64) < torch.sigmoid(z / true_t)).double()
        best = float(_log_losses(z, y, grid).min())
        assert _log_loss(z, y, fit_temperature(z, y)) <= best + 1e-6
    z = torch.tensor([40.0] * 50 + [-40.0] * 50, dtype=torch.float64)
    y = torch.tensor([1.0, 0.0] * 50, dtype=torch.float64)
    assert fit_temperature(z, y) == calibration.MAX_TEMPERATURE
    assert _log_loss(z, y, calibration.MAX_TEMPERATURE) < 0.72 < 19 < _log_loss(z, y, 1.0)
    assert fit_temperature(torch.zeros(10), y[:10]) == 1.0  # no temperature changes zero logits


def test_calibration_lowers_ece_and_has_sglang_fields(tmp_path):
    scales = [3.0, 0.4, 2.0, 1.0]
    samples = _miscalibrated(scales)
    calibration = calibrate(samples, block_size=4, dataset="synthetic")
    assert {"temperatures", "ece_before", "ece_after"} <= set(calibration)
    assert len(calibration["temperatures"]) == 4 and len(calibration["ece_after"]) == 4
    assert all(t > 0 for t in calibration["temperatures"])
    for k, scale in enumerate(scales):
        assert calibration["temperatures"][k] == pytest.approx(scale, rel=0.2)
        assert calibration["ece_after"][k] <= calibration["ece_before"][k] + 0.01
        if scale != 1.0:
            assert calibration["ece_after"][k] < 0.5 * calibration["ece_before"][k]
    assert pooled_ece(samples, calibration["temperatures"]) < pooled_ece(samples)

    path = write_calibration(tmp_path / "sts.json", calibration)
    written = json.loads(path.read_text())
    assert written["temperatures"] == calibration["temperatures"]
    assert written["dataset"] == "synthetic" and written["num_samples"] == len(samples)
    assert all(isinstance(v, float) for v in written["ece_before"] + written["ece_after"])


def test_positions_without_samples_keep_temperature_one():
    calibration = calibrate(_miscalibrated([2.0]), block_size=3)
    assert calibration["temperatures"][1:] == [1.0, 1.0]
    assert calibration["ece_before"][1:] == [None, None]  # not measured (round 36), no longer 0.0


def test_few_samples_keep_temperature_one_and_ece_is_on_held_out_samples_only(tmp_path):
    """One sample fits any temperature perfectly (T = 0.068, ECE 2e-13 once); below
    MIN_FIT_SAMPLES a position keeps T = 1. ECE, per position and pooled, is measured on
    every second sample, the ones the temperature was not fitted on."""
    from draftforge.eval.calibration import MIN_FIT_SAMPLES

    few = [(0, 2.0, 1.0)] * 3  # 2 fitting samples, 1 held out
    many = _miscalibrated([1.0, 3.0], per_position=40)
    calibration = calibrate(few + [s for s in many if s[0] == 1], block_size=2)
    assert calibration["temperatures"][0] == 1.0 and calibration["fit_samples"][0] == 2 < MIN_FIT_SAMPLES
    assert calibration["temperatures"][1] != 1.0
    assert calibration["fit_samples"] == [2, 20] and calibration["held_out_samples"] == [1, 20]
    position_1 = [s for s in many if s[0] == 1]
    assert calibration["held_out"] == [few[2]] + position_1[1::2]
    written = json.loads(write_calibration(tmp_path / "c.json", calibration).read_text())
    assert "held_out" not in written and written["fit_samples"] == [2, 20]


def test_round_samples_label_the_reached_positions():
    rounds = [
        Round(num_proposed=4, num_verified=4, num_accepted=2, acceptance_length=3, confidence_logits=[1.0, 2.0, 3.0, 4.0]),
        Round(num_proposed=4, num_verified=4, num_accepted=4, acceptance_length=5, confidence_logits=[5.0, 6.0, 7.0, 8.0]),
        Round(num_proposed=4, num_verified=1, num_accepted=1, acceptance_length=2, confidence_logits=[9.0, 0.0, 0.0, 0.0]),
        Round(num_proposed=0, num_verified=0, num_accepted=0, acceptance_length=1, confidence_logits=None),
    ]
    assert round_samples(rounds) == [
        (0, 1.0, 1.0), (1, 2.0, 1.0), (2, 3.0, 0.0),
        (0, 5.0, 1.0), (1, 6.0, 1.0), (2, 7.0, 1.0), (3, 8.0, 1.0),
        (0, 9.0, 1.0),
    ]  # fmt: skip


def test_ece_by_hand():
    probs = torch.tensor([0.05, 0.05, 0.95, 0.95])
    labels = torch.tensor([0.0, 1.0, 1.0, 1.0])
    # bin 0: mean prob 0.05, mean label 0.5 -> 0.45 * 0.5; bin 9: 0.95 vs 1.0 -> 0.05 * 0.5
    assert expected_calibration_error(probs, labels) == pytest.approx(0.25)
