"""`draftforge eval`'s option checks (review round 8): each refused before the target loads,
naming the option and where its value came from, with exit status 2."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
from eval_helpers import random_prompts, tiny_debug_recipe, tiny_eval_draft

from draftforge.config import load_recipe
from draftforge.errors import InputError
from draftforge.splitserve.target import build_target
from draftforge.train.export import export_draft


@pytest.fixture
def recipe_path(tmp_path):
    """tiny-debug with the eval helpers' 512-token vocabulary (prompts come as token ids)."""
    return tiny_debug_recipe(tmp_path)


def _with_eval(recipe_path: Path, tmp_path: Path, **keys) -> Path:
    """The recipe with ``keys`` set in its eval section (two-space indented, in tiny-debug)."""
    head, section = recipe_path.read_text().split("\neval:\n", 1)
    for key, value in keys.items():
        section, found = re.subn(rf"^  {key}: .*$", f"  {key}: {value}", section, count=1, flags=re.M)
        if not found:
            section = f"  {key}: {value}\n" + section
    path = tmp_path / "with-eval.yaml"
    path.write_text(head + "\neval:\n" + section)
    return path


@pytest.fixture
def no_target(monkeypatch):
    """Fails a test that gets as far as loading the target."""

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the options were checked")

    monkeypatch.setattr("draftforge.splitserve.target.build_target", refuse)


def _prompts(tmp_path: Path, count: int = 1) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"workload": "w", "input_ids": ids}) for ids in random_prompts(count)))
    return path


def test_one_new_token_is_refused_since_no_round_would_run(recipe_path, tmp_path, no_target, capsys):
    """The first new token comes from the prefill: with --max-new-tokens 1 (or the recipe's
    eval.max_new_tokens 1) no verification round ran, the report was all dashes and exit 0,
    and --calibrate stopped with status 1 after decoding, writing no report."""
    from draftforge.cli import main

    prompts = _prompts(tmp_path)
    assert main(["eval", "some/draft", "--recipe", str(recipe_path), "--prompts-file", str(prompts),
                 "--max-new-tokens", "1", "--out", str(tmp_path / "r")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "--max-new-tokens 1: the first new token comes from the prompt's prefill" in err
    assert "give 2 or more" in err
    one = _with_eval(recipe_path, tmp_path, max_new_tokens=1)
    assert main(["eval", "some/draft", "--recipe", str(one), "--prompts-file", str(prompts),
                 "--out", str(tmp_path / "r")]) == 2  # fmt: skip
    assert "eval.max_new_tokens: must be greater than or equal to 2" in capsys.readouterr().err  # the recipe
    assert not (tmp_path / "r").exists()


def test_two_new_tokens_make_one_round_a_prompt(recipe_path, tmp_path):
    """The least accepted: the prefill's token, then exactly one verification round a prompt."""
    from draftforge.eval.cli import main

    recipe = load_recipe(recipe_path)
    target = build_target(recipe.target, recipe.draft.target_layer_ids)
    export_dir = export_draft(tiny_eval_draft(target), tmp_path / "export", progress=lambda _: None)
    assert main([str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(_prompts(tmp_path, 3)),
                 "--max-new-tokens", "2", "--num-prompts", "3", "--out", str(tmp_path / "r"), "--no-estimate"]) == 0  # fmt: skip
    methods = json.loads((tmp_path / "r" / "report.json").read_text())["workloads"]["w"]["methods"]
    for method in ("dspark", "ngram", "none"):
        assert methods[method]["prompt_rounds"] == [1, 1, 1], method
    assert methods["none"]["acceptance_length"] == 1.0


def test_workloads_and_a_prompts_file_together_are_refused(recipe_path, tmp_path, no_target, capsys):
    """--workloads was silently ignored beside --prompts-file: the report held the file's workloads."""
    from draftforge.cli import main

    prompts = _prompts(tmp_path)
    assert main(["eval", "some/draft", "--recipe", str(recipe_path), "--prompts-file", str(prompts),
                 "--workloads", "gsm8k,mtbench", "--out", str(tmp_path / "r")]) == 2  # fmt: skip
    assert (f"--workloads gsm8k,mtbench and --prompts-file {prompts}: give one; the file's rows name "
            "their own workloads") in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_calibration_under_threshold_verification_is_refused(recipe_path, tmp_path, no_target, capsys):
    """Threshold verification reaches only slots whose confidence is at or above the threshold:
    calibrating on them fits the head on a sample cut by the head's own output."""
    from draftforge.cli import main

    prompts = _prompts(tmp_path)
    base = ["eval", "some/draft", "--prompts-file", str(prompts), "--calibrate", str(tmp_path / "c.json"),
            "--out", str(tmp_path / "r")]
    assert main([*base, "--recipe", str(recipe_path), "--verify", "threshold"]) == 2
    err = capsys.readouterr().err
    assert "--calibrate with threshold verification: it verifies only the slots before the first" in err
    assert "give --verify full" in err
    threshold = _with_eval(recipe_path, tmp_path, verify="threshold")
    assert main([*base, "--recipe", str(threshold)]) == 2
    assert "--calibrate with threshold verification (the recipe's eval.verify)" in capsys.readouterr().err
    assert not (tmp_path / "r").exists() and not (tmp_path / "c.json").exists()


def test_a_prompts_file_that_is_not_text_is_named(recipe_path, tmp_path, no_target, capsys):
    """A gzipped JSONL failed with a UnicodeDecodeError traceback naming no file."""
    from draftforge.cli import main
    from draftforge.eval.cli import _prompts_from_file

    packed = tmp_path / "prompts.jsonl.gz"
    packed.write_bytes(gzip.compress(b'{"workload": "w", "input_ids": [1, 2]}\n'))
    with pytest.raises(InputError, match=r"prompts.jsonl.gz: not UTF-8 text \(byte 1: invalid start byte\)"):
        _prompts_from_file(str(packed), None)
    assert main(["eval", "some/draft", "--recipe", str(recipe_path), "--prompts-file", str(packed),
                 "--out", str(tmp_path / "r")]) == 2  # fmt: skip
    assert f"{packed}: not UTF-8 text" in capsys.readouterr().err
    marked = tmp_path / "bom.jsonl"  # as Windows editors save UTF-8: the mark is no part of line 1
    marked.write_bytes(b'\xef\xbb\xbf{"workload": "w", "input_ids": [1, 2]}\n')
    assert _prompts_from_file(str(marked), None) == ({"w": [[1, 2]]}, {"w": [1]})


def test_workloads_on_a_target_without_a_tokenizer_are_refused(tmp_path, capsys):
    """The workloads' prompts are text: a target with no tokenizer (a random one of a
    vocabulary smaller than SmolLM2's tokenizer can be cut to) failed with a RuntimeError
    traceback, status 1."""
    from draftforge.cli import main

    recipe_path = tiny_debug_recipe(tmp_path, vocab_size=128)
    recipe = load_recipe(recipe_path)
    target = build_target(recipe.target, recipe.draft.target_layer_ids)
    export_dir = export_draft(tiny_eval_draft(target, vocab_size=128), tmp_path / "export",
                              progress=lambda _: None)
    assert main(["eval", str(export_dir), "--recipe", str(recipe_path), "--workloads", "gsm8k",
                 "--max-new-tokens", "4", "--out", str(tmp_path / "r")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "workload 'gsm8k': its prompts are text, and target 'random' has vocab_size 128 and no tokenizer" in err
    assert "give --prompts-file with token ids instead" in err
    assert not (tmp_path / "r").exists()


def test_a_random_target_beside_a_recipe_without_a_shape_is_refused(tmp_path, no_target, capsys):
    """--target random with a recipe whose target declares no shape (SmolLM2's) skipped the
    config's check and failed later with a ValueError traceback, status 1."""
    from draftforge.cli import main

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-cpu.yaml"
    assert load_recipe(recipe).target.shape is None
    assert main(["eval", "some/draft", "--recipe", str(recipe), "--target", "random", "--prompts-file",
                 str(_prompts(tmp_path)), "--out", str(tmp_path / "r")]) == 2  # fmt: skip
    assert (f"--target random: a random target is built from the recipe's target.shape, and {recipe} "
            "declares none (its target is 'smollm2-135m-instruct')") in capsys.readouterr().err


def test_calibration_without_samples_writes_the_report_and_exits_2(recipe_path, tmp_path, monkeypatch, capsys):
    """Every prompt ends at its first token (here: every token ends the answer), so no draft
    position is verified: the report is still written, the calibration file is not, and the
    exit status is 2 (it was SystemExit 1 before the report, losing the decoding)."""
    from draftforge.cli import main
    from draftforge.eval import cli as eval_cli

    recipe = load_recipe(recipe_path)
    target = build_target(recipe.target, recipe.draft.target_layer_ids)
    export_dir = export_draft(tiny_eval_draft(target), tmp_path / "export", progress=lambda _: None)
    monkeypatch.setattr(eval_cli, "_eos_ids", lambda target: list(range(512)))
    out = tmp_path / "r"
    assert main(["eval", str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(_prompts(tmp_path, 2)),
                 "--max-new-tokens", "4", "--calibrate", str(tmp_path / "sts.json"),
                 "--out", str(out)]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert f"--calibrate {tmp_path / 'sts.json'}: no confidence samples were recorded" in err
    assert (out / "report.json").is_file() and not (tmp_path / "sts.json").exists()
