"""``draftforge eval compare`` pairs two reports only when they were decoded alike.

The prompts (digest, count) are checked in test_eval_uncertainty.py; here the decoding
settings: target, dtype, temperature, max_new_tokens, seed, top-k and top-p when sampling, verification
mode, and the block size wherever n-gram takes part. The drafts may differ."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from draftforge.cli import main

TINY_DEBUG = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"


def _write(folder: Path, *, workloads=None, **changes) -> Path:
    """A report.json as draftforge eval writes it (hand-made metrics), with ``changes`` to
    its top-level keys or, as ``settings__key`` / ``target_config__key``, to nested ones."""
    report = {
        "command": "draftforge eval ...",
        "draft": str(folder / "draft"),
        "target": "smollm2-135m-instruct",
        "target_config": {"model": "smollm2-135m-instruct", "dtype": "float32", "backend": "hf",
                          "seed": 0, "shape": None},
        "settings": {"max_new_tokens": 128, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
                     "verify": "full", "threshold": 0.5,
                     "seed": 0, "baselines": ["none", "ngram"], "ngram_max": 3, "ngram_match": "latest",
                     "tie_tolerance": 0.001, "estimate": True, "estimate_anchors": 64},
        "block_size": 4,
        "workloads": workloads or {"w": {
            "num_prompts": 5, "prompt_digest": "abc",
            "methods": {m: {"acceptance_length": al, "prompt_rounds": [4, 3, 5, 2, 6],
                            "prompt_al_sum": [6.0 * al / 1.5, 5.0, 7.0, 3.0, 8.0]}
                        for m, al in (("dspark", 1.6), ("ngram", 1.4), ("none", 1.0))},
        }},
    }  # fmt: skip
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            report[section][field] = value
        elif value is None:
            del report[section]
        else:
            report[section] = value
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report))
    return folder / "report.json"


@pytest.mark.parametrize(
    ("change", "methods", "named", "flag"),
    [
        ({"settings__temperature": 1.0}, ("dspark", "dspark"), "settings.temperature is 0.0 in A, 1.0 in B", "--temperature"),
        ({"settings__max_new_tokens": 64}, ("dspark", "ngram"), "settings.max_new_tokens is 128 in A, 64 in B", "--max-new-tokens"),
        ({"target_config__dtype": "bfloat16"}, ("ngram", "ngram"), "target_config.dtype is 'float32' in A, 'bfloat16' in B", "--dtype"),
        ({"target": "qwen3-8b"}, ("dspark", "dspark"), "target is 'smollm2-135m-instruct' in A, 'qwen3-8b' in B", "--target"),
        ({"settings__verify": "threshold"}, ("dspark", "dspark"), "settings.verify is 'full' in A, 'threshold' in B", "--verify"),
        ({"block_size": 8}, ("dspark", "ngram"), "block_size is 4 in A, 8 in B", "block size"),
        ({"block_size": 8}, ("ngram", "ngram"), "block_size is 4 in A, 8 in B", "block size"),
        ({"settings__ngram_max": 4}, ("ngram", "ngram"), "settings.ngram_max is 3 in A, 4 in B", "n-gram order"),
        ({"settings__ngram_match": "earliest"}, ("ngram", "ngram"), "settings.ngram_match is 'latest' in A, 'earliest' in B", "--ngram-match"),
    ],
)  # fmt: skip
def test_compare_refuses_reports_decoded_differently(tmp_path, capsys, change, methods, named, flag):
    a = _write(tmp_path / "a")
    b = _write(tmp_path / "b", **change)
    status = main(["eval", "compare", str(a), str(b), "--a-method", methods[0], "--b-method", methods[1]])
    assert status == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no table, no verdict
    err = captured.err
    assert err.startswith(f"draftforge eval compare: error: A ({a}) and B ({b}) were not decoded with the same settings")
    assert named in err and flag in err and "Traceback" not in err


def test_compare_sampled_reports_need_the_same_seed_and_threshold(tmp_path, capsys):
    sampled = {"settings__temperature": 0.7, "settings__seed": 1}
    a = _write(tmp_path / "a", **sampled)
    assert main(["eval", "compare", str(a), str(_write(tmp_path / "b", **{**sampled, "settings__seed": 2}))]) == 2
    assert "settings.seed is 1 in A, 2 in B" in capsys.readouterr().err
    thr = {"settings__verify": "threshold", "settings__threshold": 0.5}
    a = _write(tmp_path / "c", **thr)
    assert main(["eval", "compare", str(a), str(_write(tmp_path / "d", **{**thr, "settings__threshold": 0.9}))]) == 2
    assert "settings.threshold is 0.5 in A, 0.9 in B" in capsys.readouterr().err
    for key, flag in (("top_k", "--top-k"), ("top_p", "--top-p")):
        other = {"top_k": 20, "top_p": 0.8}[key]
        b = _write(tmp_path / f"b-{key}", **{**sampled, f"settings__{key}": other})
        # against the sampled report: the greedy threshold one above uses no top-k or top-p
        assert main(["eval", "compare", str(tmp_path / "a" / "report.json"), str(b)]) == 2
        err = capsys.readouterr().err
        assert f"settings.{key} is" in err and f"{other!r} in B" in err and flag in err
    drafting = {**sampled, "settings__draft_sampling": "greedy"}
    a = _write(tmp_path / "g", **drafting)
    b = _write(tmp_path / "s", **{**drafting, "settings__draft_sampling": "sample"})
    assert main(["eval", "compare", str(a), str(b)]) == 2  # how the drafts were proposed
    err = capsys.readouterr().err
    assert "settings.draft_sampling is 'greedy' in A, 'sample' in B" in err and "--draft-sampling" in err
    for methods in (("ngram", "ngram"), ("dspark", "ngram")):  # n-gram's drafts do not depend on it
        assert main(["eval", "compare", str(a), str(b), "--a-method", methods[0], "--b-method", methods[1],
                     "--draws", "2000"]) == 0  # fmt: skip
    assert capsys.readouterr().err == ""
    rnd = {"target": "random", "target_config__model": "random", "target_config__seed": 0}
    a = _write(tmp_path / "e", **rnd)
    assert main(["eval", "compare", str(a), str(_write(tmp_path / "f", **{**rnd, "target_config__seed": 1}))]) == 2
    assert "target_config.seed is 0 in A, 1 in B" in capsys.readouterr().err


def test_compare_lets_the_drafts_and_unused_settings_differ(tmp_path, capsys):
    a = _write(tmp_path / "a")
    # another draft (block 8) and settings that do not shape these numbers: a seed while
    # greedy, a threshold under full verification, other baselines, the estimate
    b = _write(tmp_path / "b", block_size=8, settings__seed=5, settings__threshold=0.9,
               settings__baselines=["none"], settings__estimate=False, draft="elsewhere")  # fmt: skip
    assert main(["eval", "compare", str(a), str(b), "--draws", "2000"]) == 0
    captured = capsys.readouterr()
    assert "note: the drafts' block sizes differ (A 4, B 8)" in captured.out
    assert captured.out.strip().splitlines()[-1].startswith("diff_macro=")
    assert captured.err == ""
    # a draft in one report against the n-gram baseline of another decoded alike
    c = _write(tmp_path / "c", settings__verify="threshold")  # the baselines always verify in full
    assert main(["eval", "compare", str(c), str(a), "--b-method", "ngram", "--draws", "2000"]) == 0
    assert capsys.readouterr().err == ""


def test_compare_warns_about_settings_an_older_report_does_not_record(tmp_path, capsys):
    a = _write(tmp_path / "a")
    old = _write(tmp_path / "old", target_config=None)  # before draftforge eval recorded it
    assert main(["eval", "compare", str(a), str(old), "--draws", "2000"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip().splitlines()[-1].startswith("diff_macro=")
    assert captured.err == (
        f"draftforge eval compare: warning: {old} does not record target_config.dtype, "
        "target_config.backend (an older draftforge eval wrote it), so whether both reports "
        "used the same is not checked\n"
    )
    # what the older report does record is still checked
    older = _write(tmp_path / "older", target_config=None, settings__max_new_tokens=64)
    assert main(["eval", "compare", str(a), str(older)]) == 2
    assert "settings.max_new_tokens is 128 in A, 64 in B" in capsys.readouterr().err


def test_eval_records_the_target_settings_and_compare_checks_real_reports(tmp_path, capsys):
    """Two real evaluations of the same prompts with different max_new_tokens: their
    n-gram baselines differ for that reason alone, and compare refuses to pair them."""
    from eval_helpers import random_prompts, tiny_eval_draft

    from draftforge.config import load_recipe
    from draftforge.splitserve.target import build_target
    from draftforge.train.export import export_draft

    recipe_path = tmp_path / "tiny-debug-512.yaml"
    recipe_path.write_text(re.sub(r"vocab_size: 49152.*", "vocab_size: 512", TINY_DEBUG.read_text()))
    recipe = load_recipe(recipe_path)
    target = build_target(recipe.target, recipe.draft.target_layer_ids)
    export_dir = export_draft(tiny_eval_draft(target), tmp_path / "export", progress=lambda _: None)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"workload": "w", "input_ids": ids}) for ids in random_prompts(2)))
    outs = {}
    for name, tokens in (("short", "6"), ("short2", "6"), ("long", "12")):
        outs[name] = tmp_path / name
        assert main(["eval", str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
                     "--max-new-tokens", tokens, "--out", str(outs[name]), "--no-estimate"]) == 0  # fmt: skip
    capsys.readouterr()
    report = json.loads((outs["short"] / "report.json").read_text())
    assert report["target_config"] == {
        "model": "random", "dtype": recipe.target.dtype, "backend": "hf", "seed": 0,
        "shape": recipe.target.shape.model_dump(),
    }  # fmt: skip
    assert main(["eval", "compare", str(outs["short"]), str(outs["short2"]), "--draws", "2000"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["eval", "compare", str(outs["short"]), str(outs["long"]),
                 "--a-method", "ngram", "--b-method", "ngram"]) == 2  # fmt: skip
    assert "settings.max_new_tokens is 6 in A, 12 in B" in capsys.readouterr().err
