"""Review round 56 of ``draftforge eval`` (``eval/cli.py``, ``eval/report.py``): what the user
asked for is no longer changed without a word: a --num-prompts above a workload's prompts
(measured all, said per workload and recorded in the report), and a workload or baseline
named twice (refused on the command line, kept once and said from a recipe)."""

from __future__ import annotations

import json

import pytest
from eval_helpers import random_prompts
from test_evalcli_r11 import recipe_path, tiny_export  # noqa: F401 - fixtures

QUICK = ["--max-new-tokens", "4", "--no-estimate"]


def test_num_prompts_above_a_workloads_prompts_is_said_and_recorded(recipe_path, tiny_export, tmp_path,
                                                                    monkeypatch, capsys):
    """--num-prompts 4 with a workload of 3 prompts measured the 3, and the report read as if 4
    were: now a line says so, report.md gives the prompts measured per workload and report.json
    the number asked beside them. The recipe's eval.num_prompts with a --prompts-file is said alike."""
    from draftforge.cli import main
    from draftforge.data import workloads

    real = workloads.load_workload
    monkeypatch.setattr(workloads, "load_workload", lambda name: real(name)[: {"mtbench": 3, "gsm8k": 5}[name]])
    out = tmp_path / "r"
    assert main(["eval", str(tiny_export), "--recipe", str(recipe_path), "--workloads", "mtbench,gsm8k",
                 "--num-prompts", "4", "--baselines", "none", *QUICK, "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "eval: --num-prompts 4: workload 'mtbench' has only 3 prompts; all 3 are measured" in lines
    assert not any("'gsm8k' has only" in line for line in lines)
    report = json.loads((out / "report.json").read_text())
    assert report["num_prompts_requested"] == 4
    assert {name: w["num_prompts"] for name, w in report["workloads"].items()} == {"mtbench": 3, "gsm8k": 4}
    assert ("Prompts per workload: mtbench 3, gsm8k 4 (all of a workload with fewer than the 4 asked)."
            in (out / "report.md").read_text().splitlines())

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"workload": "w", "input_ids": random_prompts(1)[0]}) + "\n")
    assert main(["eval", str(tiny_export), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
                 "--baselines", "none", *QUICK, "--out", str(out)]) == 0
    assert (f"eval: the recipe's eval.num_prompts 2: --prompts-file {prompts} holds only 1 prompt of "
            "workload 'w'; it is measured") in capsys.readouterr().out.splitlines()
    report = json.loads((out / "report.json").read_text())
    assert report["num_prompts_requested"] == 2 and report["workloads"]["w"]["num_prompts"] == 1


@pytest.mark.parametrize("argv,message", [
    (["--workloads", "gsm8k,humaneval,gsm8k"],
     "argument --workloads: 'gsm8k' given more than once, and each runs once: give gsm8k,humaneval"),
    (["--baselines", "ngram, none,ngram"],
     "argument --baselines: 'ngram' given more than once, and each runs once: give ngram,none"),
])
def test_a_workload_or_baseline_given_twice_is_refused(argv, message, capsys):
    """--workloads gsm8k,gsm8k ran gsm8k once without a word, as --baselines ngram,ngram did
    ngram: refused as an unknown name is, with the option, status 2."""
    from draftforge.eval.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["some/draft", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_a_recipe_listing_a_workload_or_baseline_twice_is_said(recipe_path, tiny_export, tmp_path, monkeypatch,
                                                               capsys):
    """The recipe's eval.workloads and eval.baselines were de-duplicated without a word, and
    report.json's settings recorded the baselines twice: each runs once, now said."""
    from draftforge.cli import main
    from draftforge.eval import cli as eval_cli

    recipe_path.write_text(recipe_path.read_text().replace(
        "eval:\n", "eval:\n  workloads: [gsm8k, mtbench, gsm8k]\n  baselines: [ngram, ngram]\n"))
    monkeypatch.setattr(eval_cli, "_workload_prompts", lambda *args: random_prompts(1))
    out = tmp_path / "r"
    assert main(["eval", str(tiny_export), "--recipe", str(recipe_path), *QUICK, "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "eval: the recipe's eval.workloads lists 'gsm8k' more than once; each is measured once" in lines
    assert "eval: the recipe's eval.baselines lists 'ngram' more than once; each is measured once" in lines
    report = json.loads((out / "report.json").read_text())
    assert list(report["workloads"]) == ["gsm8k", "mtbench"] and report["settings"]["baselines"] == ["ngram"]
