"""The evaluator, review round 14: --calibrate with too few prompts to hold any out, the
held-out prompts per workload, compare's --draws bound, EvalSettings' baselines, and the
train-time estimate's target layers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from eval_helpers import LAYER_IDS, random_prompts, tiny_eval_draft
from test_eval_r13 import QUIET, _workload, draft, target  # noqa: F401  (fixtures)
from test_eval_r13 import _report as r13_report

from draftforge.cli import main
from draftforge.config import load_recipe
from draftforge.errors import InputError
from draftforge.eval.harness import EvalSettings, run_workload
from draftforge.splitserve.hf_backend import HFTarget
from draftforge.splitserve.target import build_target
from draftforge.train.export import export_draft

TINY_DEBUG = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"


def _tiny_export(tmp_path: Path) -> tuple[Path, Path]:
    """tiny-debug with the eval helpers' 512-token vocabulary, and a draft exported for it."""
    recipe_path = tmp_path / "tiny-debug-512.yaml"
    recipe_path.write_text(re.sub(r"vocab_size: 49152.*", "vocab_size: 512", TINY_DEBUG.read_text()))
    recipe = load_recipe(recipe_path)
    built = build_target(recipe.target, recipe.draft.target_layer_ids)
    return recipe_path, export_draft(tiny_eval_draft(built), tmp_path / "export", progress=lambda _: None)


def test_calibrate_with_one_prompt_a_workload_is_refused_before_the_target_loads(tmp_path, capsys, monkeypatch):
    """Every second prompt of each workload is held out: with one prompt a workload none was, the
    run printed "ECE (pooled over the 0 held-out samples) nan -> nan", wrote null ECEs into
    report.json and an OUT.json whose ECE 0 measured nothing, after decoding every prompt."""
    import draftforge.splitserve.target as target_module

    recipe_path, export_dir = _tiny_export(tmp_path)

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before --calibrate was checked")

    monkeypatch.setattr(target_module, "build_target", no_target)
    prompts = tmp_path / "prompts.jsonl"
    rows = zip(["w", "v", "u"], random_prompts(3, length=10), strict=True)
    prompts.write_text("\n".join(json.dumps({"workload": w, "input_ids": ids}) for w, ids in rows) + "\n")
    cal = tmp_path / "sts.json"
    base = ["eval", str(export_dir), "--recipe", str(recipe_path), "--max-new-tokens", "6",
            "--calibrate", str(cal), "--out", str(tmp_path / "r")]  # fmt: skip
    cases = [
        (["--prompts-file", str(prompts)], f"{prompts} holds one prompt a workload"),
        (["--prompts-file", str(prompts), "--num-prompts", "1"], "--num-prompts is 1"),
        (["--workloads", "mtbench,gsm8k", "--num-prompts", "1"], "--num-prompts is 1"),
    ]
    for extra, given in cases:
        assert main([*base, *extra]) == 2, extra
        assert capsys.readouterr().err.strip() == (
            f"draftforge eval: error: --calibrate {cal}: every second prompt of each "
            f"workload is held out to measure the ECE after fitting, and {given}, so none would be: "
            "give a workload 2 prompts or more (one to fit on, one held out)"
        ), extra
    one = tmp_path / "one.yaml"  # the recipe's eval.num_prompts
    one.write_text(recipe_path.read_text().replace("  num_prompts: 2\n", "  num_prompts: 1\n"))
    assert load_recipe(one).eval.num_prompts == 1
    assert main([*base[:3], str(one), *base[4:], "--workloads", "mtbench"]) == 2
    assert "held out to measure the ECE after fitting, and the recipe's eval.num_prompts is 1, so none would be" in (
        capsys.readouterr().err)
    assert not cal.exists() and not (tmp_path / "r").exists()


def test_calibrate_holds_out_every_second_prompt_of_each_workload():
    """The README promises every second prompt of each workload held out; the code alternated over
    the prompts of all workloads in order of appearance, skipping prompts that gave no sample:
    one prompt in each of three workloads held out the middle workload's, and a workload whose
    second prompt gave no sample held out its third."""
    from draftforge.eval.calibration import calibrate

    prompts = [("w", 0), ("v", 0), ("u", 0), ("u", 1), ("x", 0), ("x", 2), ("x", 3), ("x", 4)]  # x 1 gave none
    samples, prompt_ids = [], []
    for prompt in prompts:
        for z in (-1.5, -0.5, 0.25, 1.0, 2.0):
            samples.append((len(samples) % 2, z + len(samples) / 100, float(z > 0)))
            prompt_ids.append(prompt)
    calibration = calibrate(samples, block_size=2, prompt_ids=prompt_ids)
    held = {("u", 1), ("x", 3)}  # the odd indices within each workload
    want = [s for s, p in zip(samples, prompt_ids, strict=True) if p in held]
    assert sorted(calibration["held_out"]) == sorted(want)
    assert calibration["held_out_samples"] == [sum(1 for s in want if s[0] == k) for k in range(2)] == [5, 5]
    assert calibration["fit_samples"] == [15, 15]
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] must be a \(workload, prompt index >= 0\) pair, got 'w'"):
        calibrate(samples, block_size=2, prompt_ids=["w"] * len(samples))


def _report(folder: Path, rounds: list[int]) -> Path:
    """A report.json as draftforge eval writes it, one workload with these prompts' rounds."""
    return r13_report(folder, {"w": _workload(rounds, num_prompts=len(rounds))})


def test_compare_refuses_draws_that_would_exhaust_memory(tmp_path, capsys):
    """--draws 100000000 (a typo for 10000000, or one zero too many) set out to hold 100 million x
    the prompts resampled indices, several copies over: tens of GB, until the machine ran out."""
    from draftforge.eval import compare
    from draftforge.eval.uncertainty import least_draws

    assert compare.MAX_RESAMPLED == 100_000_000  # (without the bound, the run below takes 8 GB)
    report = _report(tmp_path / "a", [4, 3, 5, 2, 6])
    assert main(["eval", "compare", str(report), "--draws", "100000000"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        "draftforge eval compare: error: --draws 100,000,000: each draw resamples the 5 prompts of "
        "workload 'w', 500,000,000 prompt indices held in memory at once (about 8 GB); give at most "
        "20,000,000 draws (the default is 10,000)"
    )
    # a level that would need more draws than memory allows says so
    many = _report(tmp_path / "b", [3] * 100)
    assert main(["eval", "compare", str(many), "--draws", "2000000", "--level", "0.999999"]) == 2
    # (read at its expanded level at 100 prompts, tests/test_compare_r58.py: more than the nominal
    # level's 2,000,000)
    least = least_draws(0.999999, 100)
    assert least > 2_000_000
    assert capsys.readouterr().err.strip().endswith(
        "200,000,000 prompt indices held in memory at once (about 3 GB); give at most 1,000,000 draws "
        f"(the default is 10,000); --level 0.999999 needs {least:,}: lower it"
    )
    assert main(["eval", "compare", str(report), "--draws", "2000"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "diff_macro=0.2500 low=0.2500 high=0.2500 verdict=ahead"


def test_eval_settings_refuse_unknown_baselines(target, draft):
    """A library caller's misspelt baseline ("ngarm") was left out of the report without a word,
    and a bare string ("none,ngram") was read by substring."""
    for baselines in (("ngarm",), ("none", "dspark"), "none,ngram", None):
        with pytest.raises(InputError) as caught:
            EvalSettings(baselines=baselines)
        assert str(caught.value) == (
            f"EvalSettings.baselines must be a sequence of names out of ngram, none, got {baselines!r}"
        )
    settings = EvalSettings(max_new_tokens=4, estimate=False, baselines=["ngram"])
    result = run_workload("w", random_prompts(1), draft, target, settings, **QUIET)
    assert sorted(result.methods) == ["dspark", "ngram", "none"]  # greedy: none is the reference anyway


def test_the_estimate_refuses_a_target_built_with_other_layers(target, draft):
    """The estimate read the draft's features from the layers the target was built with, while
    decoding captures the draft's target_layer_ids: a target built with the same layers in
    another order gave a plausible tau of another draft input, without a word."""
    from draftforge.eval.estimate import train_time_estimate

    reordered = HFTarget(target.model, None, list(reversed(LAYER_IDS)), name="random")
    prompt = random_prompts(1)[0]
    output = list(range(5, 15))
    message = ("train-time estimate: target 'random' captures layers [2, 1, 0] but the draft reads "
               "target_layer_ids [0, 1, 2]; build the target with the draft's target_layer_ids")
    with pytest.raises(InputError) as caught:
        train_time_estimate(draft, reordered, [(prompt, output)])
    assert str(caught.value) == message
    decoded = []  # refused before any prompt is decoded
    with pytest.raises(InputError) as caught:
        run_workload("w", [prompt], draft, reordered, EvalSettings(max_new_tokens=4), progress=decoded.append)
    assert str(caught.value) == message and decoded == []
    # the target with the draft's layers, and the reordered one with the estimate off, still run
    assert train_time_estimate(draft, target, [(prompt, output)])["num_blocks"] > 0
    run_workload("w", [prompt], draft, reordered, EvalSettings(max_new_tokens=4, estimate=False), **QUIET)
