"""Session 51: recipe eval settings that greedy decoding or full verification do not use are
said, and report.json records the settings decoding used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from eval_helpers import random_prompts
from test_eval_cli import _tiny_export_and_prompts, recipe_path  # noqa: F401 - the fixture

from draftforge.eval.cli import main


def _eval(recipe, tmp_path, capsys, extra=()):
    export_dir, prompts = _tiny_export_and_prompts(recipe, tmp_path)
    out = tmp_path / "r"
    assert main([str(export_dir), "--recipe", str(recipe), "--prompts-file", str(prompts),
                 "--max-new-tokens", "6", "--baselines", "none", "--no-estimate", "--out", str(out),
                 *extra]) == 0  # fmt: skip
    return json.loads((out / "report.json").read_text())["settings"], capsys.readouterr().out


def test_sampling_settings_a_greedy_eval_ignores_are_said_and_not_recorded(recipe_path, tmp_path, capsys):  # noqa: F811
    """--top-k and the like are refused at temperature 0; the recipe's eval.top_k, top_p and
    draft_sampling were ignored without a word and written to report.json as if they applied."""
    recipe = tmp_path / "sampling.yaml"
    text = recipe_path.read_text()
    assert "\neval:\n" in text
    recipe.write_text(text.replace("\neval:\n", "\neval:\n  top_k: 20\n  top_p: 0.8\n  draft_sampling: sample\n"
                                   "  confidence_threshold: 0.9\n", 1))
    settings, out = _eval(recipe, tmp_path, capsys)
    assert (settings["top_k"], settings["top_p"], settings["draft_sampling"]) == (0, 1.0, "greedy")
    assert ("eval: not applied from the recipe: eval.top_k 20, eval.top_p 0.8, eval.draft_sampling 'sample' "
            "(decoding is greedy: temperature 0); eval.confidence_threshold 0.9 ('full' verification "
            "verifies every drafted slot)") in out
    # sampling uses them, and says nothing
    settings, out = _eval(recipe, tmp_path, capsys, ["--temperature", "0.7", "--verify", "threshold"])
    assert (settings["top_k"], settings["top_p"], settings["draft_sampling"]) == (20, 0.8, "sample")
    assert "not applied from the recipe" not in out


def test_a_recipe_without_such_settings_gets_no_note(recipe_path, tmp_path, capsys):  # noqa: F811
    settings, out = _eval(recipe_path, tmp_path, capsys)
    assert "not applied from the recipe" not in out and settings["draft_sampling"] == "greedy"
    # a run's config.yaml writes every key, the default threshold among them
    written = tmp_path / "config.yaml"
    text = recipe_path.read_text()
    written.write_text(text.replace("\neval:\n", "\neval:\n  confidence_threshold: 0.5\n", 1))
    _, out = _eval(written, tmp_path, capsys)
    assert "not applied from the recipe" not in out


def _refused(argv, capsys) -> str:
    from test_cli_r15 import _run

    code, _, err = _run(argv, capsys)
    assert code == 2
    return err


def test_outputs_that_would_write_over_this_runs_inputs_are_refused(recipe_path, tmp_path, capsys):  # noqa: F811
    """--calibrate wrote its JSON over the draft's model.safetensors, the prompts file or the
    recipe (exit 0, the draft then unreadable); --calibrate naming the --out folder failed after
    the whole run with 'File exists'; --out inside the export made a later export into it fail."""
    export_dir, prompts = _tiny_export_and_prompts(recipe_path, tmp_path)
    prompts.write_text("".join(json.dumps({"workload": "w", "input_ids": ids}) + "\n" for ids in random_prompts(2)))
    weights = (export_dir / "model.safetensors").read_bytes()
    notes = tmp_path / "notes.txt"
    notes.write_text("precious")
    base = ["eval", str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
            "--max-new-tokens", "6", "--baselines", "none", "--no-estimate"]
    out = tmp_path / "r"
    cases = [
        (["--out", str(out), "--calibrate", str(export_dir / "model.safetensors")], "is in the draft's files"),
        (["--out", str(out), "--calibrate", str(export_dir / "sts.json")], "is in the draft's files"),
        (["--out", str(out), "--calibrate", str(prompts)], f"is --prompts-file {prompts}, which this run reads"),
        (["--out", str(out), "--calibrate", str(recipe_path)], f"is --recipe {recipe_path}, which this run reads"),
        (["--out", str(out), "--calibrate", str(out)], f"is the --out folder {out}"),
        (["--out", str(out), "--calibrate", str(notes)], "an existing file that is not a calibration"),
        (["--out", str(export_dir / "eval")], f"is inside {export_dir}, the draft's own files"),
        (["--out", ""], "--out: empty path"),
        (["--out", str(out), "--calibrate", ""], "--calibrate: empty path"),
    ]
    if Path("/proc/self").is_dir():  # Linux: os.access said root could write in /proc
        cases.append((["--out", "/proc/draftforge-none/x"], "--out /proc/draftforge-none/x: cannot write in /proc"))
    for extra, said in cases:
        err = _refused([*base, *extra], capsys)
        assert said in err, (extra, err)
    assert (export_dir / "model.safetensors").read_bytes() == weights and notes.read_text() == "precious"
    assert not out.exists() and not (export_dir / "eval").exists() and not (export_dir / "sts.json").exists()
    # an earlier calibration is replaced, as before
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"temperatures": [1.0]}))
    assert main([*base[1:], "--out", str(out), "--calibrate", str(calibration)]) == 0
    assert len(json.loads(calibration.read_text())["temperatures"]) > 0


def test_export_refuses_an_empty_out(tmp_path, capsys):
    """'draftforge export RUN --out ""' fell back to the default folder without a word."""
    err = _refused(["export", str(tmp_path / "run"), "--out", ""], capsys)
    assert "--out: empty path" in err


def test_a_workload_name_that_breaks_the_report_tables_is_refused_with_its_line(tmp_path):
    """A prompts file's workload 'a|b' split its report.md rows into extra cells, and '' gave
    blank ones."""
    from draftforge.errors import InputError
    from draftforge.eval.cli import _prompts_from_file

    for name in ("a|b", "", "  ", "two\nlines"):
        path = tmp_path / "prompts.jsonl"
        path.write_text(json.dumps({"workload": "fine", "input_ids": [1, 2]}) + "\n"
                        + json.dumps({"workload": name, "input_ids": [1, 2]}) + "\n")
        with pytest.raises(InputError, match=rf"{path}:2: workload .*: give a name that is not blank"):
            _prompts_from_file(str(path), None)


def test_bench_objective_refuses_a_block_of_one():
    """--block 1 passed argparse and failed in the worker with a ValueError excerpt (exit 1)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "draftforge", "bench", "objective", "--block", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--block: must be at least 2" in done.stderr


def test_a_run_folder_takes_its_report_and_calibration_beside_its_checkpoints(recipe_path, tmp_path, capsys):  # noqa: F811
    """RUN/eval is where 'draftforge export RUN' finds the report for the model card: an --out
    there must stay accepted; only the run's checkpoints are refused."""
    from eval_helpers import tiny_eval_draft
    from test_export import _write_checkpoint

    from draftforge.config import load_recipe
    from draftforge.splitserve.target import build_target

    _, prompts = _tiny_export_and_prompts(recipe_path, tmp_path)
    prompts.write_text("".join(json.dumps({"workload": "w", "input_ids": ids}) + "\n" for ids in random_prompts(2)))
    recipe = load_recipe(recipe_path)
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_00000002"
    _write_checkpoint(step, tiny_eval_draft(build_target(recipe.target, recipe.draft.target_layer_ids)))
    (step / "COMPLETE").touch()
    (step / "trainer_state.json").write_text("{}")
    base = ["eval", str(run), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
            "--max-new-tokens", "6", "--baselines", "none", "--no-estimate"]
    err = _refused([*base, "--out", str(step / "eval")], capsys)
    assert f"is inside {run / 'checkpoints'}, the draft's own files" in err
    assert main([*base[1:], "--out", str(run / "eval"), "--calibrate", str(run / "calibration.json")]) == 0
    assert (run / "eval" / "report.json").is_file() and (run / "calibration.json").is_file()


def test_a_second_eval_into_the_same_out_is_refused(recipe_path, tmp_path, capsys):  # noqa: F811
    """Two evaluations into one --out (the default runs/eval, say) replaced each other's report,
    or left one's report.md beside the other's report.json; the lock file goes when it ends."""
    from draftforge.files import exclusive_lock

    export_dir, prompts = _tiny_export_and_prompts(recipe_path, tmp_path)
    out = tmp_path / "r"
    argv = ["eval", str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
            "--max-new-tokens", "6", "--baselines", "none", "--no-estimate", "--out", str(out)]
    with exclusive_lock(tmp_path / ".r.eval.lock"):  # the first evaluation, in another process
        err = _refused(argv, capsys)
    assert f"--out {out}: another draftforge eval is writing its report there (process" in err
    assert main(argv[1:]) == 0 and (out / "report.json").is_file()
    assert not (tmp_path / ".r.eval.lock").exists()


def test_export_uses_an_evaluation_of_a_run_only_for_the_weights_it_read(recipe_path, tmp_path, capsys):  # noqa: F811
    """'eval RUN --out RUN/eval' read checkpoint N; a save of N+1 during its minutes of decoding
    left its report newer than N+1, so 'export RUN' put N's acceptance table on N+1's card."""
    import os

    import torch
    from eval_helpers import tiny_eval_draft
    from test_export import _write_checkpoint

    from draftforge.config import load_recipe
    from draftforge.splitserve.target import build_target

    _, prompts = _tiny_export_and_prompts(recipe_path, tmp_path)
    prompts.write_text("".join(json.dumps({"workload": "w", "input_ids": ids}) + "\n" for ids in random_prompts(2)))
    recipe = load_recipe(recipe_path)
    draft = tiny_eval_draft(build_target(recipe.target, recipe.draft.target_layer_ids))
    run = tmp_path / "run"

    def save(step: int):
        folder = run / "checkpoints" / f"step_{step:08d}"
        _write_checkpoint(folder, draft)
        (folder / "COMPLETE").touch()
        (folder / "trainer_state.json").write_text("{}")
        return folder

    save(2)
    assert main([str(run), "--recipe", str(recipe_path), "--prompts-file", str(prompts), "--max-new-tokens", "6",
                 "--baselines", "none", "--no-estimate", "--out", str(run / "eval")]) == 0  # fmt: skip
    report = run / "eval" / "report.json"
    assert json.loads(report.read_text())["draft_fingerprint"].startswith("tensors:")
    from draftforge.cli import main as draftforge_main

    assert draftforge_main(["export", str(run), "--out", str(tmp_path / "e1")]) == 0
    assert f"model card: acceptance table from {run / 'eval' / 'report.md'}" in capsys.readouterr().out
    with torch.no_grad():
        draft.fc.weight.add_(0.01)  # the next optimizer step
    newer = save(4)
    past = report.stat().st_mtime - 60  # saved while the evaluation still decoded
    os.utime(newer / "COMPLETE", (past, past))
    os.utime(newer / "model.safetensors", (past, past))
    assert draftforge_main(["export", str(run), "--out", str(tmp_path / "e2")]) == 0
    out = capsys.readouterr().out
    assert "measured other weights than checkpoint step_00000004 holds" in out
    assert "Not measured" in (tmp_path / "e2" / "README.md").read_text()
