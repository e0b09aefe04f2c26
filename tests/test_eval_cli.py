"""`draftforge eval` end to end on the tiny-debug recipe's random target, and the report files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from eval_helpers import random_prompts, smollm2_draft, tiny_eval_draft

from draftforge.config import load_recipe
from draftforge.errors import InputError
from draftforge.splitserve.target import build_target
from draftforge.train.export import export_draft

TINY_DEBUG = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"


@pytest.fixture
def recipe_path(tmp_path):
    """tiny-debug with the eval helpers' 512-token vocabulary (prompts come as token ids)."""
    text = re.sub(r"vocab_size: 49152.*", "vocab_size: 512", TINY_DEBUG.read_text())
    path = tmp_path / "tiny-debug-512.yaml"
    path.write_text(text)
    return path


def test_eval_cli_with_export_prompts_file_and_calibration(recipe_path, tmp_path, capsys):
    from draftforge.cli import main

    recipe = load_recipe(recipe_path)
    target = build_target(recipe.target, recipe.draft.target_layer_ids)
    draft = tiny_eval_draft(target)
    assert draft.config.target_layer_ids == recipe.draft.target_layer_ids
    export_dir = export_draft(draft, tmp_path / "export", progress=lambda _: None)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"workload": w, "input_ids": ids}) for w, ids in
                  zip(["alpha", "alpha", "beta"], random_prompts(3), strict=True))  # fmt: skip
    )
    out = tmp_path / "report"
    status = main([
        "eval", str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
        "--max-new-tokens", "10", "--calibrate", str(tmp_path / "sts.json"), "--out", str(out),
    ])  # fmt: skip
    assert status == 0
    stdout = capsys.readouterr().out
    assert "al_dspark=" in stdout and "al_ngram=" in stdout and "al_none=1.000" in stdout
    report = json.loads((out / "report.json").read_text())
    assert set(report["workloads"]) == {"alpha", "beta"}
    assert report["draft"] == str(export_dir) and report["draft_path"] == str(export_dir.resolve())
    alpha = report["workloads"]["alpha"]
    assert alpha["num_prompts"] == 2 and set(alpha["methods"]) == {"dspark", "ngram", "none"}
    assert alpha["methods"]["none"]["acceptance_length"] == 1.0
    assert len(alpha["methods"]["dspark"]["position_acceptance"]) == 4
    assert alpha["train_time_estimate"]["tau"] >= 1.0
    table = (out / "report.md").read_text()
    assert "| alpha | dspark |" in table and "tau (c*)" in table
    assert "Decoding: greedy, every output checked identical to plain greedy decoding." in table
    # where n-gram lookup proposes: the JSON's split, rendered in the report
    est = alpha["train_time_estimate"]
    assert 0.0 <= est["lookup_share"] <= 1.0
    row = next(line for line in table.splitlines() if line.startswith("| alpha |") and " % |" in line)
    assert row.split("|")[2].strip() == f"{100 * est['lookup_share']:.0f} %"
    # per-prompt totals and the intervals built from them
    assert alpha["methods"]["dspark"]["prompt_rounds"] and len(alpha["prompt_digest"]) == 16
    paired = report["uncertainty"]["paired"]["dspark-ngram"]
    assert set(paired) == {"alpha", "beta", "macro"}
    assert paired["macro"]["low"] <= paired["macro"]["value"] <= paired["macro"]["high"]
    assert "dspark minus ngram, paired on the same prompts" in table
    assert main(["eval", "compare", str(out), "--draws", "500"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("diff_macro=") and "verdict=" in last
    for name in ("acceptance_length.png", "position_acceptance.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    calibration = json.loads((tmp_path / "sts.json").read_text())
    assert len(calibration["temperatures"]) == 4
    assert {"temperatures", "ece_before", "ece_after"} <= set(calibration)


def test_eval_from_training_checkpoint(recipe_path, tmp_path, capsys):
    """The DFlash ablation has no DSpark export; it is evaluated from its checkpoint folder."""
    from dataclasses import asdict

    from safetensors.torch import save_file

    from draftforge.eval.cli import main

    recipe = load_recipe(recipe_path)
    target = build_target(recipe.target, recipe.draft.target_layer_ids)
    draft = tiny_eval_draft(target, markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    state = {k: v for k, v in draft.state_dict().items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    save_file({k: v.contiguous() for k, v in state.items()}, str(ckpt / "model.safetensors"))
    (ckpt / "draft_config.json").write_text(json.dumps(asdict(draft.config)))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"workload": "w", "input_ids": random_prompts(1)[0]}))
    assert main([str(ckpt), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
                 "--max-new-tokens", "8", "--out", str(tmp_path / "r"), "--no-estimate"]) == 0  # fmt: skip
    assert "al_dspark=" in capsys.readouterr().out
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["workloads"]["w"]["methods"]["dspark"]["acceptance_length"] >= 1.0


def _tiny_export_and_prompts(recipe_path, tmp_path):
    recipe = load_recipe(recipe_path)
    target = build_target(recipe.target, recipe.draft.target_layer_ids)
    export_dir = export_draft(tiny_eval_draft(target), tmp_path / "export", progress=lambda _: None)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"workload": "w", "input_ids": random_prompts(1)[0]}))
    return export_dir, prompts


def test_eval_runs_an_sglang_recipes_target_in_transformers(recipe_path, tmp_path, capsys):
    """A GPU recipe trains with target.backend sglang; the verifier drives the model's KV cache
    itself, so eval loads the same weights in transformers, says so and records it."""
    from draftforge.eval.cli import main

    export_dir, prompts = _tiny_export_and_prompts(recipe_path, tmp_path)
    sglang_recipe = tmp_path / "sglang.yaml"
    sglang_recipe.write_text(recipe_path.read_text().replace("target:\n", "target:\n  backend: sglang\n", 1))
    assert load_recipe(sglang_recipe).target.backend == "sglang"
    assert main([str(export_dir), "--recipe", str(sglang_recipe), "--prompts-file", str(prompts),
                 "--max-new-tokens", "6", "--out", str(tmp_path / "r"), "--no-estimate",
                 "--device", "cpu"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "target.backend 'sglang' is for training; the evaluator runs the same weights in transformers" in out
    assert "on cpu" in out
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["target_config"]["backend"] == "hf" and report["device"] == "cpu"


@pytest.mark.parametrize("device,message", [
    ("cuda:1", "--device 'cuda:1': no CUDA GPU is visible"),
    ("tpu", "--device 'tpu' is not a device"),
    ("cuda:0,cuda:1", "--device 'cuda:0': no CUDA GPU is visible"),
])
def test_eval_refuses_a_device_it_cannot_use(recipe_path, tmp_path, capsys, monkeypatch, device, message):
    import torch

    from draftforge.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["eval", str(tmp_path), "--recipe", str(recipe_path), "--device", device]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_eval_on_the_gpu_is_lossless_and_counts_as_on_the_cpu(recipe_path, tmp_path):
    """--device cuda: the target and the draft on the GPU, every greedy output checked against
    plain decoding there (a mismatch exits 3). The acceptance lengths stay near the CPU run's:
    float32 throughout, but the GPU's kernels may break a near-tie of the random draft otherwise."""
    from draftforge.eval.cli import main

    export_dir, prompts = _tiny_export_and_prompts(recipe_path, tmp_path)
    reports = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / device
        assert main([str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
                     "--max-new-tokens", "16", "--out", str(out), "--dtype", "float32",
                     "--device", device]) == 0  # fmt: skip
        reports[device] = json.loads((out / "report.json").read_text())["workloads"]["w"]["methods"]
    assert reports["cuda"]["none"]["acceptance_length"] == 1.0
    for method in ("dspark", "ngram"):
        assert reports["cuda"][method]["acceptance_length"] == pytest.approx(
            reports["cpu"][method]["acceptance_length"], abs=0.25)


@pytest.mark.integration
def test_eval_cli_on_smollm2_workloads(recipe_path, tmp_path, capsys):
    """Real workloads, chat template and EOS through SmolLM2 (float32): greedy stays lossless."""
    from draftforge.cli import main
    from draftforge.splitserve import smollm2
    from draftforge.splitserve.config import TargetConfig

    layers = [1, 14, 27]
    target = build_target(TargetConfig(model=smollm2.NAME, dtype="float32"), layers)
    export_dir = export_draft(smollm2_draft(target, layers), tmp_path / "export", progress=lambda _: None)
    status = main([
        "eval", str(export_dir), "--target", smollm2.NAME, "--workloads", "humaneval,gsm8k",
        "--num-prompts", "1", "--max-new-tokens", "12", "--out", str(tmp_path / "r"),
    ])  # fmt: skip
    assert status == 0
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert set(report["workloads"]) == {"humaneval", "gsm8k"}
    assert "al_ngram=" in capsys.readouterr().out


def test_report_json_marks_a_finished_evaluation_so_it_is_written_last(recipe_path, tmp_path, monkeypatch):
    """The demo skips an evaluation whose report.json exists; an interruption while the
    plots are drawn must leave none, so that a rerun draws them."""
    from draftforge.eval import report as report_mod
    from draftforge.eval.cli import main

    recipe = load_recipe(recipe_path)
    target = build_target(recipe.target, recipe.draft.target_layer_ids)
    export_dir = export_draft(tiny_eval_draft(target), tmp_path / "export", progress=lambda _: None)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"workload": "w", "input_ids": random_prompts(1)[0]}))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(report_mod, "plot", interrupted)
    args = [str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
            "--max-new-tokens", "6", "--out", str(tmp_path / "r"), "--baselines", "none"]
    with pytest.raises(KeyboardInterrupt):
        main(args)
    # the plots come first, then report.md, then report.json: an interrupted plot leaves neither
    assert not (tmp_path / "r" / "report.md").exists() and not (tmp_path / "r" / "report.json").exists()
    macro = tmp_path / "macro.jsonl"
    macro.write_text(json.dumps({"workload": "macro", "input_ids": [1, 2]}))
    with pytest.raises(InputError, match="macro.jsonl:1: workload name 'macro' is reserved"):
        main([str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(macro)])


def test_a_malformed_prompts_file_is_refused_before_the_target_loads(recipe_path, tmp_path, monkeypatch):
    """input_ids given as a string or a mapping used to be read digit by digit or key by key."""
    import draftforge.splitserve.target as target_module
    from draftforge.eval.cli import main

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the prompts file was checked")

    monkeypatch.setattr(target_module, "build_target", no_target)
    for row, message in (({"input_ids": "1234"}, 'got "1234"'), ({"input_ids": {"7": 1}}, 'got {"7": 1}'),
                         ({"input_ids": [1, True]}, "got \\[1, true\\]"),
                         ({"input_ids": [1], "workload": 3}, "workload must be a string, got 3"),
                         ([1, 2], "not a prompt row \\(an array, not an object\\)"),
                         ({"input_ids": [4, -1, 2]}, "token id -1 is negative")):  # fmt: skip
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps({"input_ids": [5, 6]}) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(InputError, match=f"bad.jsonl:2: .*{message}"):
            main([str(tmp_path / "nodraft"), "--recipe", str(recipe_path), "--prompts-file", str(path)])
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")  # it used to load the target and write a report of nan
    with pytest.raises(InputError, match="blank.jsonl: no prompts, every line is blank"):
        main([str(tmp_path / "nodraft"), "--recipe", str(recipe_path), "--prompts-file", str(blank)])


def test_a_prompts_file_token_outside_the_vocabulary_is_named_before_decoding(recipe_path, tmp_path):
    """An id the target's embedding has no row for failed as a bare IndexError inside decoding."""
    from draftforge.eval.cli import main

    export_dir, prompts = _tiny_export_and_prompts(recipe_path, tmp_path)
    vocab = load_recipe(recipe_path).target.shape.vocab_size
    rows = [json.dumps({"workload": "w", "input_ids": [3, 4]}), "",
            json.dumps({"workload": "w", "input_ids": [3, vocab]})]
    prompts.write_text("\n".join(rows) + "\n")
    with pytest.raises(InputError, match=f"prompts.jsonl:3: token id {vocab} is outside the target's "
                                         f"vocabulary \\({vocab} ids, 0 to {vocab - 1}\\)"):
        main([str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
              "--max-new-tokens", "4", "--out", str(tmp_path / "r")])
    assert not (tmp_path / "r").exists()


def test_threshold_verification_and_calibration_need_a_confidence_head(recipe_path, tmp_path, capsys):
    """The DFlash ablation has no confidence head: asking to verify by it or calibrate it is refused
    at once (it failed with a traceback after the first prompt, or after the whole evaluation)."""
    from draftforge.eval.cli import main

    recipe = load_recipe(recipe_path)
    target = build_target(recipe.target, recipe.draft.target_layer_ids)
    headless = tiny_eval_draft(target, enable_confidence_head=False, confidence_head_with_markov=False)
    export_dir = export_draft(headless, tmp_path / "export", progress=lambda _: None)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"workload": "w", "input_ids": random_prompts(1)[0]}))
    base = [str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
            "--max-new-tokens", "6", "--out", str(tmp_path / "r"), "--baselines", "none"]
    for extra, what in ((["--verify", "threshold"], "--verify threshold"),
                        (["--calibrate", str(tmp_path / "c.json")], "--calibrate")):  # fmt: skip
        with pytest.raises(InputError, match=f"{what} needs the draft's confidence head"):
            main([*base, *extra])
    assert not (tmp_path / "r").exists() and not (tmp_path / "c.json").exists()
    assert main(base) == 0  # full verification needs none


def test_sampled_eval_records_its_sampling_settings_and_greedy_refuses_them(recipe_path, tmp_path, capsys):
    from draftforge.eval.cli import main

    export_dir, prompts = _tiny_export_and_prompts(recipe_path, tmp_path)
    base = [str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
            "--max-new-tokens", "8", "--baselines", "ngram"]
    assert main([*base, "--temperature", "0.8", "--top-k", "8", "--top-p", "0.9",
                 "--draft-sampling", "sample", "--out", str(tmp_path / "r")]) == 0  # fmt: skip
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    settings = report["settings"]
    # the train-time estimate at these settings beside the others
    for entry in report["workloads"].values():
        assert 1.0 <= entry["train_time_estimate"]["tau_sampled"] <= 5.0
    assert "| tau_greedy | tau_sampled |" in (tmp_path / "r" / "report.md").read_text()
    assert (settings["temperature"], settings["top_k"], settings["top_p"]) == (0.8, 8, 0.9)
    assert settings["draft_sampling"] == "sample"
    assert ("Decoding: sampled at temperature 0.8, top-k 8, top-p 0.9, seed 0; the draft draws its tokens "
            "from its own distribution, each accepted with min(1, p_t/p_d).") in (tmp_path / "r" / "report.md").read_text()
    assert "al_dspark=" in capsys.readouterr().out
    from draftforge.errors import InputError

    with pytest.raises(InputError, match=r"--top-p 0.9, --draft-sampling sample: only for sampling, but the "
                                         r"temperature is 0 \(greedy decoding"):
        main([*base, "--top-p", "0.9", "--draft-sampling", "sample", "--out", str(tmp_path / "g")])
    assert not (tmp_path / "g").exists()  # refused before anything ran


def test_the_reports_decoding_line_names_each_sampling_setting():
    from draftforge.eval.report import decoding_line

    assert decoding_line({"temperature": 0.7, "top_k": 20, "top_p": 0.8, "seed": 3, "draft_sampling": "greedy"}) == (
        "Decoding: sampled at temperature 0.7, top-k 20, top-p 0.8, seed 3; the draft proposes its most likely "
        "tokens, each accepted with the target's probability of it.")  # fmt: skip
    assert decoding_line({"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 0, "draft_sampling": "sample"}) == (
        "Decoding: sampled at temperature 1.0, seed 0; the draft draws its tokens from its own distribution, "
        "each accepted with min(1, p_t/p_d).")  # fmt: skip
    assert decoding_line({"temperature": 0.0}).startswith("Decoding: greedy")


def test_eval_help_names_its_exit_statuses(capsys):
    from draftforge.eval.cli import build_parser

    help_text = " ".join(build_parser().format_help().split())
    assert "Exit status: 0 done; 2 refused input" in help_text
    assert "3 the greedy lossless check failed" in help_text


def test_the_reports_decoding_line_names_threshold_verification_and_the_ngram_rule():
    from draftforge.eval.report import decoding_line

    greedy = "Decoding: greedy, every output checked identical to plain greedy decoding."
    threshold = {"temperature": 0.0, "verify": "threshold", "threshold": 0.7, "baselines": ["none"]}
    assert decoding_line(threshold) == (
        f"{greedy} The draft's blocks are cut at a static confidence threshold of 0.7: only the slots "
        "before the first whose confidence is below it are verified (SGLang serves no static threshold, "
        "so these figures do not predict its acceptance).")  # fmt: skip
    ngram = {"temperature": 0.0, "verify": "full", "baselines": ["ngram"], "ngram_max": 3}
    assert decoding_line(ngram | {"ngram_match": "earliest"}) == (
        f"{greedy} n-gram: the longest suffix n-gram (up to 3) first, copied from the earliest (vLLM's "
        "rule) earlier match.")  # fmt: skip
    assert decoding_line(ngram | {"ngram_match": "latest"}).endswith("copied from the most recent earlier match.")
    assert decoding_line(ngram) == greedy  # a report from before the rule was recorded says nothing of it


def test_the_report_does_not_call_outputs_identical_that_diverged_at_a_near_tie(monkeypatch):
    """check_lossless stops at a divergence where plain decoding's top-2 margin is below the
    tolerance; report.md said every output was identical all the same."""
    from draftforge.eval.harness import WorkloadResult
    from draftforge.eval.report import decoding_line, markdown_table

    greedy = {"temperature": 0.0, "tie_tolerance": 0.001}
    assert decoding_line(greedy) == "Decoding: greedy, every output checked identical to plain greedy decoding."
    line = ("Decoding: greedy, every output checked identical to plain greedy decoding up to the end, "
            "except 3 that diverged at a numerical near-tie (top-2 logit margin below 0.001) and are "
            "identical up to it (not checked after it; report.json: lossless_near_ties).")
    assert decoding_line(greedy, 3) == line
    results = [WorkloadResult(name=name, num_prompts=0, near_ties=ties) for name, ties in (("a", 1), ("b", 2))]
    monkeypatch.setattr("draftforge.eval.report.uncertainty_lines", lambda u: [])  # no rounds here
    assert line in markdown_table(results, block_size=4, settings=greedy, intervals={})


@pytest.mark.parametrize("argv,message", [
    (["--top-p", "0"], "argument --top-p: must lie in (0, 1], got 0"),
    (["--top-k", "-1"], "argument --top-k: must be 0 or more, got -1"),
    (["--num-prompts", "0"], "argument --num-prompts: must be at least 1, got 0"),
    (["--max-new-tokens", "-3"], "argument --max-new-tokens: must be at least 1, got -3"),
    (["--temperature", "-1"], "argument --temperature: must be 0 or more, got -1"),
    (["--threshold", "1.5"], "argument --threshold: must lie in [0, 1], got 1.5"),
    (["--baselines", "none,ngarm"], "argument --baselines: unknown 'ngarm'; valid: none, ngram"),
    (["--workloads", "humaneval,gsm8kk"], "argument --workloads: unknown 'gsm8kk'; valid: humaneval, mtbench, gsm8k"),
])
def test_eval_refuses_impossible_arguments_before_loading_anything(argv, message, capsys):
    """They used to run anyway: 0 prompts meant the recipe's, -1 all but the last, a
    misspelt baseline was dropped and a misspelt workload failed after the target loaded."""
    from draftforge.eval.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["some/draft", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_eval_names_a_missing_prompts_file_or_target(tmp_path, capsys):
    from draftforge.cli import main

    assert main(["eval", str(tmp_path), "--target", "smollm2-135m-instruct", "--prompts-file",
                 str(tmp_path / "p.jsonl")]) == 2
    assert f"--prompts-file {tmp_path / 'p.jsonl'}: no such file" in capsys.readouterr().err
    assert main(["eval", str(tmp_path)]) == 2
    assert (f"give --target NAME_OR_DIR (or --recipe RECIPE): the draft records no training recipe (no "
            f"recipe.yaml or config.yaml with {tmp_path})") in capsys.readouterr().err


def test_eval_cli_fails_loudly_when_greedy_is_not_lossless(recipe_path, tmp_path, capsys, monkeypatch):
    from draftforge.eval import speculative
    from draftforge.eval.cli import main

    export_dir, prompts = _tiny_export_and_prompts(recipe_path, tmp_path)
    monkeypatch.setattr(
        speculative, "greedy_accept", lambda drafts, logits: (len(drafts), int(logits[len(drafts)].argmax()))
    )
    status = main([str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
                   "--max-new-tokens", "12", "--out", str(tmp_path / "r"), "--tie-tolerance", "0",
                   "--baselines", "none"])  # fmt: skip
    assert status == 3
    assert "LOSSLESS CHECK FAILED" in capsys.readouterr().err
    assert not (tmp_path / "r" / "report.json").exists()


def test_eval_says_up_front_that_it_replaces_an_earlier_report(tmp_path, capsys):
    from draftforge.eval.cli import _warn_replacing

    out = tmp_path / "report"
    _warn_replacing(out)  # no folder yet: nothing to say
    out.mkdir()
    _warn_replacing(out)  # a folder without a report: nothing either
    assert capsys.readouterr().out == ""
    (out / "report.json").write_text(json.dumps({"draft": "runs/a/export", "workloads": {}}))
    _warn_replacing(out)
    said = capsys.readouterr().out
    assert f"eval: {out} holds a report of draft runs/a/export from " in said and "this run replaces it" in said
    # one that draftforge eval did not write (the user's own, or unreadable): refused, not replaced
    from draftforge.errors import InputError

    for text in ("{cut", json.dumps({"mine": 1}), "[]"):
        (out / "report.json").write_text(text)
        with pytest.raises(InputError, match="holds a report.json that is no draftforge evaluation report"):
            _warn_replacing(out)
        assert (out / "report.json").read_text() == text


def test_a_gpu_index_beyond_the_visible_ones_is_named(monkeypatch):
    import torch

    from draftforge.errors import InputError
    from draftforge.splitserve.target import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == "cuda:1"
    assert resolve_device("auto", [1, 2]) == "cuda:1"
    with pytest.raises(InputError, match=r"device cuda:2 \(--device\): only 2 GPU"):
        resolve_device("cuda:2")
    with pytest.raises(InputError, match=r"device cuda:4 \(the recipe's first target GPU\): only 2 GPU"):
        resolve_device("auto", [4, 5])  # a recipe whose target GPUs start at 4


def test_another_target_than_the_recipes_is_checked_against_its_own_shape(recipe_path, tmp_path):
    """--target replaces the recipe's target, and with it the shape the recipe declared for its
    own: a draft built for the recipe's random target is refused for SmolLM2's, before loading."""
    from draftforge.errors import InputError
    from draftforge.eval.cli import main

    export_dir, prompts = _tiny_export_and_prompts(recipe_path, tmp_path)
    with pytest.raises((InputError, SystemExit)) as info:
        main([str(export_dir), "--recipe", str(recipe_path), "--target", "smollm2-135m-instruct",
              "--prompts-file", str(prompts), "--out", str(tmp_path / "r")])  # fmt: skip
    message = str(info.value)
    assert "smollm2-135m-instruct" in message and "target.shape" not in message, message


def test_unwritable_out_and_calibrate_paths_are_refused_before_the_target_loads(
        recipe_path, tmp_path, capsys, monkeypatch):
    """They were refused only when written, after every workload was decoded, by an OSError
    that named neither option."""
    import draftforge.splitserve.target as target_module
    from draftforge.cli import main
    from draftforge.eval import cli

    export_dir, prompts = _tiny_export_and_prompts(recipe_path, tmp_path)

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before --out and --calibrate were checked")

    monkeypatch.setattr(target_module, "build_target", no_target)
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    a_folder = tmp_path / "folder"
    a_folder.mkdir()
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "gone")
    base = ["eval", str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
            "--max-new-tokens", "4"]
    cases = [
        (["--out", str(a_file)], f"--out {a_file}: is a file, not a folder"),
        (["--out", str(a_file / "sub")], f"--out {a_file / 'sub'}: {a_file} is a file, not a folder"),
        (["--out", str(dangling)], f"--out {dangling}: is a symbolic link to nothing"),
        (["--out", str(tmp_path / "r"), "--calibrate", str(a_folder)],
         f"--calibrate {a_folder}: is a folder; give the path of the JSON file"),
        (["--out", str(tmp_path / "r"), "--calibrate", str(a_file / "cal.json")],
         f"--calibrate {a_file / 'cal.json'}: {a_file} is a file, not a folder"),
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == 2, extra
        assert f"draftforge eval: error: {message}" in capsys.readouterr().err, extra
    assert a_file.read_text() == "x" and not (tmp_path / "r").exists()

    # a folder it may not write in (checked by making a folder there: root may write anywhere
    # by permission, so the refusal is simulated)
    locked = tmp_path / "locked"
    locked.mkdir()
    from draftforge import files

    real_folder = files.tempfile.TemporaryDirectory

    def refusing(*args, dir=None, **kwargs):
        if Path(dir) == locked:
            raise PermissionError(13, "Permission denied")
        return real_folder(*args, dir=dir, **kwargs)

    monkeypatch.setattr(files.tempfile, "TemporaryDirectory", refusing)
    assert main([*base, "--out", str(locked / "new" / "report")]) == 2
    assert f"--out {locked / 'new' / 'report'}: cannot write in {locked} (Permission denied)" in capsys.readouterr().err
    assert main([*base, "--out", str(tmp_path / "r"), "--calibrate", str(locked / "cal.json")]) == 2
    assert f"--calibrate {locked / 'cal.json'}: cannot write in {locked}" in capsys.readouterr().err
    # folders that do not exist yet are made when written: accepted
    cli._check_output_paths(str(tmp_path / "a" / "b"), str(tmp_path / "c" / "d" / "cal.json"))
    cli._check_output_paths(str(a_folder), str(a_file))  # an existing report folder, a calibration replaced


def test_workload_prompts_need_a_chat_template_as_training_prompts_do():
    """A tokenizer without a chat template: eval said what transformers says; now the same
    input error as training (status 2), naming the setting to give."""
    from draftforge.data.tokenize import ChatTemplateError
    from draftforge.eval.cli import workload_texts
    from draftforge.splitserve.config import GenerationConfig

    class NoTemplate:
        chat_template = None

        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")

    with pytest.raises(ChatTemplateError, match="set target.generation.chat_template"):
        workload_texts("gsm8k", NoTemplate(), GenerationConfig(), 1)

    class Template(NoTemplate):
        chat_template = "{{ messages[0]['content'] }}"

        def apply_chat_template(self, messages, **kwargs):
            return "<" + messages[0]["content"][:10] + ">"

    assert workload_texts("gsm8k", Template(), GenerationConfig(), 2)[0].startswith("<")


def test_the_near_tie_tolerance_defaults_by_the_targets_dtype(recipe_path, tmp_path, capsys):
    """bfloat16 logits of batched verification and one-token decoding differ by up to about a
    logit (eval/config.py), so a bf16 target gets a wider default than float32's 1e-3; a
    given --tie-tolerance is kept, and a negative one refused before anything runs."""
    from draftforge.eval.cli import main

    export_dir, prompts = _tiny_export_and_prompts(recipe_path, tmp_path)
    base = [str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
            "--max-new-tokens", "4", "--baselines", "none", "--no-estimate"]
    used = {}
    for name, extra in {"f32": ["--dtype", "float32"], "bf16": ["--dtype", "bfloat16"],
                        "bf16-given": ["--dtype", "bfloat16", "--tie-tolerance", "0.25"]}.items():
        assert main([*base, *extra, "--out", str(tmp_path / name)]) == 0
        used[name] = json.loads((tmp_path / name / "report.json").read_text())["settings"]["tie_tolerance"]
    assert used == {"f32": 1e-3, "bf16": 1.0, "bf16-given": 0.25}
    with pytest.raises(SystemExit) as exit_info:
        main([*base, "--tie-tolerance", "-1", "--out", str(tmp_path / "neg")])
    assert exit_info.value.code == 2 and "--tie-tolerance: must be 0 or more, got -1" in capsys.readouterr().err
    assert not (tmp_path / "neg").exists()


def test_a_recipe_workload_named_twice_is_loaded_and_run_once(recipe_path, tmp_path, monkeypatch, capsys):
    """eval.workloads: [humaneval, humaneval] loaded, tokenised and checked the workload twice
    (the report kept one); --workloads already counted it once."""
    from draftforge.cli import main
    from draftforge.eval import cli as eval_cli

    recipe_path.write_text(recipe_path.read_text().replace("eval:\n", "eval:\n  workloads: [humaneval, humaneval]\n"))
    recipe = load_recipe(recipe_path)
    target = build_target(recipe.target, recipe.draft.target_layer_ids)
    export_dir = export_draft(tiny_eval_draft(target), tmp_path / "export", progress=lambda _: None)
    loaded = []

    def prompts(name, *args):
        loaded.append(name)
        return random_prompts(1)

    monkeypatch.setattr(eval_cli, "_workload_prompts", prompts)
    assert main(["eval", str(export_dir), "--recipe", str(recipe_path), "--max-new-tokens", "4",
                 "--baselines", "none", "--no-estimate", "--out", str(tmp_path / "r")]) == 0
    assert loaded == ["humaneval"]
    assert capsys.readouterr().out.count("eval: humaneval: 1 prompts") == 1
