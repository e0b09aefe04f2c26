"""Walkthrough review r36: problems a new user met running the README's commands."""

from __future__ import annotations

from test_export import _run_with_report


def test_export_eval_report_takes_the_folder_draftforge_eval_wrote(tmp_path, capsys):
    """``--eval-report runs/x/eval`` (the folder ``draftforge eval --out`` wrote, as ``eval
    compare`` takes it) used to be refused as "no such file" although it exists."""
    from draftforge.train.export_cli import main

    run, _ = _run_with_report(tmp_path, "/elsewhere/other-draft")
    folder = tmp_path / "myeval"
    folder.mkdir()
    (folder / "report.md").write_text("| gsm8k | 3.21 |\n")
    assert main([str(run), "--eval-report", str(folder)]) == 0
    assert "| gsm8k | 3.21 |" in (run / "export" / "README.md").read_text()
    assert f"model card: acceptance table from {folder / 'report.md'}\n" in capsys.readouterr().out


def test_export_eval_report_folder_without_report_md_says_so(tmp_path, capsys):
    from draftforge.cli import main

    run, _ = _run_with_report(tmp_path, "/elsewhere/other-draft")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(run), "--eval-report", str(empty)]) == 2
    err = capsys.readouterr().err
    assert f"--eval-report {empty}: a folder without report.md" in err and "no such file" not in err
    assert not (run / "export").exists()


def test_eval_prompts_file_row_without_input_ids_names_its_keys(tmp_path):
    """A text prompt or a misspelt key (``inputids``) was reported as "input_ids must be a list of
    token ids, got null", as if the ids were there but malformed."""
    import json
    from pathlib import Path

    import pytest

    from draftforge.errors import InputError
    from draftforge.eval.cli import main

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"workload": "x", "input_ids": [5, 6]}) + "\n"
                    + json.dumps({"workload": "x", "inputids": [5, 6]}) + "\n")
    with pytest.raises(InputError, match=r"prompts.jsonl:2: the row has no input_ids \(its keys: workload, "
                                         r"inputids\); expected"):
        main([str(tmp_path / "nodraft"), "--recipe", str(recipe), "--prompts-file", str(path)])


def test_eval_compare_given_report_md_points_at_report_json(tmp_path, capsys):
    """``eval compare runs/eval/report.md`` said only "not valid JSON" of the markdown report."""
    from draftforge.cli import main

    report = tmp_path / "report.md"
    report.write_text("Command: `draftforge eval ...`\n\n| workload | method |\n")
    assert main(["eval", "compare", str(report)]) == 2
    err = capsys.readouterr().err
    assert f"{report}: not valid JSON" in err
    assert "give the report's report.json or the folder holding it" in err and "Traceback" not in err


def test_eval_refusals_name_the_command_once(tmp_path, capsys):
    """The command line's handler puts ``draftforge eval: error:`` before a refusal; nine of
    eval's own refusals began with ``draftforge eval:`` as well, so the prefix came twice."""
    from draftforge.cli import main

    export = tmp_path / "export"
    export.mkdir()
    assert main(["eval", str(export)]) == 2
    assert capsys.readouterr().err.strip() == (
        "draftforge eval: error: give --target NAME_OR_DIR (or --recipe RECIPE): the draft records no "
        f"training recipe (no recipe.yaml or config.yaml with {export})")
