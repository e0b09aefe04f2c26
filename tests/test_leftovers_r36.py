"""Review round 36: a calibration's unmeasured ECE and its bound-hit temperature, the training
summary's two target lines, a mistyped target folder, and "1 threads"."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from draftforge.eval import calibration
from draftforge.eval.calibration import MAX_TEMPERATURE, calibrate, write_calibration
from draftforge.eval.report import calibration_lines

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"


def _samples(position: int, count: int, *, logit: float, accepted: float):
    return [(position, logit, accepted)] * count


def test_a_position_without_held_out_samples_has_no_ece_not_a_perfect_one(tmp_path):
    """A tiny draft's position that no held-out prompt reached was reported ECE 0.0: a perfect
    calibration never measured. Now None (null in report.json, "n/a" in report.md); SGLang's
    file, whose reader takes lists of floats only, gets its ECE lists empty (its default)."""
    gen = torch.Generator().manual_seed(0)
    z = (torch.randn(40, generator=gen) * 2).tolist()
    samples = [(0, v, float(v > 0)) for v in z] + _samples(1, 1, logit=1.0, accepted=1.0)
    result = calibrate(samples, block_size=3)  # position 1: 1 sample (fitted), position 2: none
    assert result["held_out_samples"] == [20, 0, 0]
    assert result["ece_before"][1:] == [None, None] and result["ece_after"][1:] == [None, None]
    assert isinstance(result["ece_before"][0], float)
    assert json.loads(json.dumps(result["ece_before"]))[1] is None  # null in report.json

    written = json.loads(write_calibration(tmp_path / "sts.json", result).read_text())
    assert written["ece_before"] == [] == written["ece_after"]  # SGLang: list[float], no null
    assert written["temperatures"] == result["temperatures"]
    assert written["held_out_samples"] == [20, 0, 0]
    assert result["ece_before"][1] is None  # the caller's (report.json's) figures are kept

    meta = {**{k: v for k, v in result.items() if k != "held_out"}, "path": "sts.json",
            "pooled_ece_before": 0.1, "pooled_ece_after": 0.05}
    text = "\n".join(calibration_lines(meta))
    assert "1: n/a (no held-out sample); 2: n/a (no held-out sample)" in text
    assert f"0: {result['ece_before'][0]:.4f} -> {result['ece_after'][0]:.4f}" in text

    # every position measured: SGLang's lists are written whole, as floats
    full = calibrate(samples[:40] + [(1, v, float(v > 0)) for v in z], block_size=2)
    written = json.loads(write_calibration(tmp_path / "full.json", full).read_text())
    assert written["ece_before"] == full["ece_before"] and len(written["ece_after"]) == 2
    assert all(isinstance(v, float) for v in written["ece_before"] + written["ece_after"])


def test_a_temperature_at_the_searchs_bound_is_said_to_be_the_bound():
    """Position 0 of a tiny draft got T = 100.0, presented as fitted: it is MAX_TEMPERATURE, where
    the fit stops because the log loss still falls beyond it (nearly every draft rejected while
    the head says accept). The result says so per position, and report.md names the bound."""
    rejected = _samples(0, 30, logit=4.0, accepted=0.0) + _samples(0, 2, logit=-4.0, accepted=1.0)
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(60, generator=gen) * 2
    labels = (torch.rand(60, generator=gen) < torch.sigmoid(z)).tolist()
    fitted = [(1, float(v), float(y)) for v, y in zip(z, labels, strict=True)]
    result = calibrate(rejected + fitted, block_size=2)
    assert result["temperatures"][0] == MAX_TEMPERATURE
    assert result["temperature_at_bound"] == ["upper", None]
    assert calibration.bound_hit(calibration.MIN_TEMPERATURE) == "lower"
    assert calibration.bound_hit(1.0) is None
    meta = {**{k: v for k, v in result.items() if k != "held_out"}, "path": "x.json",
            "pooled_ece_before": 0.5, "pooled_ece_after": 0.4}
    text = "\n".join(calibration_lines(meta))
    assert "Temperature at a bound, not a fitted value: position 0 (the search's upper bound 100)" in text
    assert "position 1" not in text.split("Temperature at a bound")[1]


def test_the_targets_two_summary_lines_each_say_their_window():
    """The target's "done:" line (its whole serving: 59 %, 4,296 tokens) and the accounting's
    "target (per producer)" line (as of the last sample a trainer took: 99.7 %, 2,864 tokens)
    disagreed without a word; each now says what it covers."""
    from draftforge.splitserve.accounting import ConsumerAccounting
    from draftforge.splitserve.roles import done_line

    summary = {"busy_share": 0.59, "idle_share": 0.40, "tokens": 4296, "rate_tok_s": 100.0,
               "max_outstanding": 4, "credits": 4, "max_pending_tokens": 128}
    assert done_line(summary).startswith("done (serving, to the trainers' stop): busy 59.0% idle 40.0% 4296 tokens")
    acc = ConsumerAccounting(world=2, num_target=1, credits=4)
    acc.on_producer_stats(0, {"busy_s": 9.97, "idle_s": 0.03, "wall_s": 10.0, "tokens": 2864})
    text = acc.summary_text()
    assert "  target  (per producer, as of the last sample taken: 10 s, against the trainer's 0 s): busy 99.7%" in text
    assert "2864 tokens" in text


def test_a_missing_target_folder_is_said_before_the_missing_setting(tmp_path):
    """target.model=/tmp/nope (a typo) was diagnosed as "draft.max_position_embeddings: not set",
    steering the user to a setting; the folder, which on several nodes may be on the target's
    node alone (so it is not refused by itself), now comes first."""
    from draftforge.config import RecipeError, load_recipe

    missing = tmp_path / "nope"
    with pytest.raises(RecipeError) as err:
        load_recipe(RECIPE, [f"target.model={missing}"])
    message = str(err.value)
    assert f"target.model: no folder {missing} on this machine (a typo? or the target's folder on " \
           "another node)" in message
    assert message.index("no folder") < message.index("draft.max_position_embeddings")
    assert "fix the path" in message
    # an existing folder whose config.json gives none keeps the setting's own message
    folder = tmp_path / "there"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(RecipeError) as err:
        load_recipe(RECIPE, [f"target.model={folder}"])
    assert "draft.max_position_embeddings: not set" in str(err.value)
    assert "no folder" not in str(err.value)


def test_one_thread_is_singular(monkeypatch, capsys):
    from draftforge.train import bench_objective, bench_train

    assert bench_train._where(SimpleNamespace(device="cpu", threads=1)) == "1 thread"
    assert bench_train._where(SimpleNamespace(device="cpu", threads=2)) == "2 threads"

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(bench_objective.subprocess, "run", stop)
    for threads, said in ((1, "float32, 1 thread\n"), (3, "float32, 3 threads\n")):
        with pytest.raises(Stop):
            bench_objective.main(["--threads", str(threads), "--dtype", "float32"])
        assert capsys.readouterr().out.endswith(said)
