"""Review round 29 of the evaluation metrics (estimate, calibration, report, bootstrap,
``eval compare``), each against an independent computation written here."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest

from draftforge.eval.uncertainty import prompt_digest


def _report(path, methods: dict[str, tuple[list[int], list[int]]]):
    """A hand-made report.json of one workload: method -> (prompt_rounds, prompt_al_sum)."""
    path.mkdir(parents=True, exist_ok=True)
    num_prompts = len(next(iter(methods.values()))[0])
    entry = {m: {"prompt_rounds": r, "prompt_al_sum": s} for m, (r, s) in methods.items()}
    digest = prompt_digest([[i] for i in range(num_prompts)])
    report = {"workloads": {"w": {"num_prompts": num_prompts, "prompt_digest": digest, "methods": entry}}}
    (path / "report.json").write_text(json.dumps(report))
    return path


@pytest.mark.parametrize("level", ["0.9", "0.8", "0.95", "0.99", "0.6"])
def test_compare_accepts_the_least_draws_its_refusal_names(tmp_path, capsys, level):
    """Each tail of a level-L interval needs a draw: at least 2 / (1 - L) draws, exactly (in
    fractions). 20 draws at 0.9 were refused with "so at least 20" (and 10 at 0.8 with "at least
    10"): 20 * (1 - 0.9) / 2 is 0.9999999999999998 in floating point."""
    from draftforge.cli import main

    least = math.ceil(2 / (1 - Fraction(level)))  # exact: 20 at 0.9, 10 at 0.8, 40 at 0.95
    # four prompts: too few for a verdict, so only the nominal level is checked (from five on the
    # expanded level is: tests/test_compare_r58.py)
    report = _report(tmp_path / "r", {"dspark": ([3, 4, 2, 5], [7, 9, 4, 12]),
                                       "ngram": ([4, 4, 3, 5], [6, 8, 5, 9])})  # fmt: skip
    assert main(["eval", "compare", str(report), "--draws", str(least), "--level", level]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("diff_macro=")
    with pytest.raises(SystemExit) as info:
        main(["eval", "compare", str(report), "--draws", str(least - 1), "--level", level])
    assert info.value.code == 2
    assert f"so at least {least}" in capsys.readouterr().err


def test_the_lookup_table_of_a_dflash_draft_does_not_call_its_figures_dspark(monkeypatch):
    """The `dspark` rows measure whatever draft was evaluated (report.md names it, the DFlash
    ablation in the demo's second evaluation); the lookup split's heading and columns said
    "DSpark" over that draft's runs. They now say what the other tables say: the draft under
    test. The figures themselves are the estimate's, cell for cell."""
    from draftforge.eval.harness import WorkloadResult
    from draftforge.eval.report import markdown_table

    monkeypatch.setattr("draftforge.eval.report.uncertainty_lines", lambda u: [])
    estimate = {"tau": 1.3, "tau_greedy": 1.25, "lookup_share": 0.25, "tau_greedy_at_lookup": 1.5,
                "ngram_run_at_lookup": 2.0, "tau_greedy_elsewhere": 1.125}  # fmt: skip
    results = [WorkloadResult(name="w", num_prompts=1, estimate=estimate)]
    dflash = "a draft without a Markov head (DFlash-style; block 4, no confidence head)"
    text = markdown_table(results, block_size=4, intervals={}, draft=dflash)
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Where n-gram lookup proposes"))
    section = lines[start : start + 5]
    assert not any("DSpark" in line for line in section), section
    assert section[0] == "Where n-gram lookup proposes (the draft under test):"
    assert section[4] == "| w | 25 % | 1.50 | 2.00 | 1.12 |"
