"""Review round 16 of the demo, the eval report and the command line (``eval/demo.py``,
``eval/report.py``, ``core/cli.py``, ``core/argtypes.py``): the export stages' own
``export_dir=`` lines, the speed-up of a speed not measured, report.json's estimate note
without an estimate, repeated workloads, "1 prompts", ``draftforge help COMMAND`` and an
override given before the recipe."""

from __future__ import annotations

import json
import math
import sys

import pytest
from splitserve_helpers import tiny_recipe
from test_demo_r7 import _finished_run, _report

from draftforge import argtypes
from draftforge.cli import main as cli_main
from draftforge.config import load_recipe
from draftforge.eval import demo, demo_report, demo_stages
from draftforge.eval.harness import WorkloadResult
from draftforge.eval.report import ESTIMATE_NOTE, markdown_table, report_dict


def _trained(tmp_path, monkeypatch, *, workloads=("humaneval",), prompts: int = 8, recipe_overrides=None):
    """A recipe whose two runs are trained and whose evaluations are current (reports of
    ``prompts`` prompts a workload); returns the recipe, its paths and the evaluation
    commands the demo checked."""
    recipe = tiny_recipe(tmp_path, steps=4, overrides={"eval.workloads": list(workloads), **(recipe_overrides or {})})
    cfg = load_recipe(recipe)
    paths = demo.demo_paths(cfg)
    _finished_run(paths.run_dir, cfg.to_yaml())
    _finished_run(paths.dflash_dir, load_recipe(recipe, demo.dflash_overrides(paths)).to_yaml())
    names = list(dict.fromkeys(workloads))
    for folder, methods in ((paths.eval_dir, {"dspark": 1.5, "ngram": 1.1, "none": 1.0}),
                            (paths.dflash_eval_dir, {"dspark": 1.2, "none": 1.0})):  # fmt: skip
        folder.mkdir(parents=True, exist_ok=True)
        report = _report(dict.fromkeys(names, prompts), methods)
        (folder / "report.json").write_text(json.dumps(report))
    checked = []
    monkeypatch.setattr(demo, "eval_is_current", lambda eval_dir, args, *a, **kw: checked.append(list(args)) or True)
    monkeypatch.setattr(demo, "run_side_by_side", lambda *a, **kw: pytest.fail("an evaluation ran"))
    monkeypatch.setattr(demo, "evaluations_side_by_side", lambda threads=1: False)
    return recipe, paths, checked


def test_only_the_demos_last_line_starts_with_export_dir(tmp_path, monkeypatch, capfd):
    """The two export stages printed draftforge export's own 'export_dir=<path>' lines on the
    terminal, so a script taking the line that starts with 'export_dir=' (the README's summary
    line) got three."""
    recipe, paths, _ = _trained(tmp_path, monkeypatch)
    monkeypatch.setattr(demo, "export_is_current", lambda *a, **kw: False)
    monkeypatch.setattr(demo, "model_card_is_current", lambda *a, **kw: False)
    # draftforge export as it prints: its progress, then its folder
    from draftforge.train.export import export_digest

    script = (f"print('export: run -> out'); print('export_files={export_digest(paths.export_dir)}'); "
              f"print('export_dir={paths.export_dir}')")
    monkeypatch.setattr(demo_stages, "draftforge_command", lambda *args: [sys.executable, "-c", script])

    assert demo.main([str(recipe), "--skip-train", "--num-prompts", "8"]) == 0
    lines = capfd.readouterr().out.strip().splitlines()
    starting = [line for line in lines if line.startswith("export_dir=")]
    assert starting == [lines[-1]], starting
    assert lines[-1] == f"export_dir={paths.export_dir} al_dspark=1.500 al_dflash=1.200 al_ngram=1.100"
    # the stages' output is still shown, under their command lines
    assert lines.count(f"    export_dir={paths.export_dir}") == 2
    assert lines.count("    export: run -> out") == 2


def _method(al: float, tokens_per_s: float, wall_s: float) -> dict:
    return {"acceptance_length": al, "tokens_verified_per_round": 4.0, "tokens_per_s": tokens_per_s,
            "wall_s": wall_s, "position_acceptance": [0.5, None, None, None], "prompt_rounds": [4, 4],
            "prompt_al_sum": [4 * al, 4 * al]}  # fmt: skip


def test_the_speed_up_of_a_speed_not_measured_is_a_dash(tmp_path):
    """No-draft wall time 0: its tokens/s is NaN, which is true, so the speed-up cell read '-x'."""
    unmeasured = WorkloadResult(name="w", num_prompts=2, methods={
        "dspark": _method(1.5, 10.0, 2.0), "none": _method(1.0, math.nan, 0.0)})
    measured = WorkloadResult(name="v", num_prompts=2, methods={
        "dspark": _method(1.5, 10.0, 2.0), "none": _method(1.0, 4.0, 5.0)})
    rows = markdown_table([unmeasured, measured], block_size=4).splitlines()
    assert "| w | dspark | 1.50 | 4.00 | 10.0 | - | 2.0 |" in rows, rows
    assert "| w | none | 1.00 | 4.00 | - | - | 0.0 |" in rows, rows
    assert f"| v | dspark | 1.50 | 4.00 | 10.0 | {10.0 / 4.0:.2f}x | 2.0 |" in rows, rows
    assert "| v | none | 1.00 | 4.00 | 4.0 | 1.00x | 5.0 |" in rows, rows
    assert not any("-x" in row for row in rows)


def test_report_json_explains_the_estimate_only_where_there_is_one():
    """--no-estimate: report.json still carried 'estimate_note', the meaning of a tau it has not."""
    without = [WorkloadResult(name="w", num_prompts=2, methods={"dspark": _method(1.5, 10.0, 2.0)})]
    assert "estimate_note" not in report_dict(without, {"command": "c"})
    with_estimate = [WorkloadResult(name="w", num_prompts=2, methods={"dspark": _method(1.5, 10.0, 2.0)},
                                    estimate={"tau": 1.7, "tau_greedy": 1.6})]
    assert report_dict(with_estimate, {"command": "c"})["estimate_note"] == ESTIMATE_NOTE


def test_a_workload_named_twice_is_one_workload(tmp_path, monkeypatch, capsys):
    """--workloads humaneval,humaneval: the header said '2 workloads' and the evaluation ran one;
    a recipe's eval.workloads naming one twice did the same."""
    assert argtypes.names(demo.WORKLOADS)("humaneval, gsm8k,humaneval") == ["humaneval", "gsm8k"]
    recipe, paths, checked = _trained(tmp_path, monkeypatch)
    monkeypatch.setattr(demo, "export_is_current", lambda *a, **kw: True)
    monkeypatch.setattr(demo, "model_card_is_current", lambda *a, **kw: True)
    assert demo.main([str(recipe), "--skip-train", "--workloads", "humaneval,humaneval"]) == 0
    out = capsys.readouterr().out
    assert ", 1 workload x 8 prompts, " in out, out
    assert all(args[args.index("--workloads") + 1] == "humaneval" for args in checked) and len(checked) == 2

    (tmp_path / "twice").mkdir()
    twice, _, checked = _trained(tmp_path / "twice", monkeypatch, workloads=("humaneval", "humaneval"))
    assert demo.main([str(twice), "--skip-train"]) == 0
    assert ", 1 workload x 8 prompts, " in capsys.readouterr().out
    assert all(args[args.index("--workloads") + 1] == "humaneval" for args in checked) and len(checked) == 2


def test_one_prompt_is_one_prompt(tmp_path, monkeypatch, capsys):
    """--num-prompts 1: demo.md said '1 prompts per workload'."""
    recipe, paths, _ = _trained(tmp_path, monkeypatch, prompts=1)
    monkeypatch.setattr(demo, "export_is_current", lambda *a, **kw: True)
    monkeypatch.setattr(demo, "model_card_is_current", lambda *a, **kw: True)
    assert demo.main([str(recipe), "--skip-train", "--num-prompts", "1"]) == 0
    assert ", 1 workload x 1 prompt, " in capsys.readouterr().out
    text = paths.table.read_text()
    assert ", 1 prompt per workload, up to" in text and "1 prompts" not in text
    assert demo_report._prompts_text(8, {"humaneval": 8}) == "8 prompts per workload"


def test_help_command_gives_that_commands_help(capsys):
    """`draftforge help config show` printed the overview of every command, not its help."""
    with pytest.raises(SystemExit) as info:
        cli_main(["help", "config", "show"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: draftforge config show [-h] RECIPE [key=value ...]")
    assert cli_main(["help"]) == 0  # alone: the overview, as before
    assert capsys.readouterr().out.startswith("usage: draftforge <command> [args ...]")


@pytest.mark.parametrize("command", [["config", "show"], ["train"]])
def test_an_override_before_the_recipe_says_the_recipe_comes_first(tmp_path, capsys, command):
    """`draftforge train train.steps=5 r.yaml` said only 'train.steps=5: no such recipe file'."""
    recipe = tiny_recipe(tmp_path, steps=4)
    assert cli_main([*command, "train.steps=5", str(recipe)]) == 2
    err = capsys.readouterr().err
    name = " ".join(command)
    assert err.splitlines()[-1] == (
        f"'train.steps=5' is a key=value override: the recipe comes first, the overrides after it "
        f"(draftforge {name} RECIPE [key=value ...]{' [--dry-run]' if name == 'train' else ''})"), err
    # a misspelt recipe file is only that
    assert cli_main([*command, str(tmp_path / "nosuch.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"{tmp_path / 'nosuch.yaml'}: no such recipe file"
