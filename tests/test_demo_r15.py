"""Review round 15 of the demo and the eval report (``eval/demo.py``, ``eval/report.py``,
``eval/llamacpp_check.py``): report.md without the estimate or with a calibration, an export
folder given as ``~/...``, the demo's time on a recipe that does not regenerate, the plot of
a run without rounds, and ``eval llamacpp --work-dir``."""

from __future__ import annotations

import json

import pytest
from splitserve_helpers import tiny_recipe
from test_demo_r7 import _finished_run, _report
from test_evalcli_r11 import _prompts_file, recipe_path, tiny_export  # noqa: F401  (fixtures)

from draftforge.config import load_recipe
from draftforge.errors import InputError
from draftforge.eval import demo, demo_state
from draftforge.eval.report import ESTIMATE_NOTE
from draftforge.train.export import export_digest


def _eval(recipe_path, tiny_export, tmp_path, *extra):
    from draftforge.eval.cli import main

    out = tmp_path / "r"
    prompts = _prompts_file(tmp_path, ["alpha", "alpha", "beta", "beta"])
    assert main([str(tiny_export), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
                 "--max-new-tokens", "8", "--out", str(out), "--baselines", "none", *extra]) == 0  # fmt: skip
    return (out / "report.md").read_text(), json.loads((out / "report.json").read_text())


def test_no_estimate_leaves_the_estimate_table_and_its_note_out_of_report_md(recipe_path, tiny_export, tmp_path):
    """--no-estimate: report.md still showed the 'Train-time estimate' table, every tau a dash,
    and the paragraph explaining the tau it did not compute."""
    text, report = _eval(recipe_path, tiny_export, tmp_path, "--no-estimate")
    assert all(w["train_time_estimate"] is None for w in report["workloads"].values())
    assert "Train-time estimate" not in text and "tau_greedy" not in text
    assert ESTIMATE_NOTE not in text
    assert "No train-time estimate (`--no-estimate`)." in text.splitlines()
    # the measured sections are all still there
    assert "Per-position conditional acceptance" in text and "bootstrap intervals" in text


def test_report_md_gives_the_calibrations_pooled_ece_before_and_after(recipe_path, tiny_export, tmp_path):
    """README: 'The report gives the pooled ECE before and after', but only report.json and the
    console did; report.md (which the model card copies) said nothing of the calibration."""
    cal = tmp_path / "cal.json"
    text, report = _eval(recipe_path, tiny_export, tmp_path, "--no-estimate", "--calibrate", str(cal))
    written = json.loads(cal.read_text())  # SGLang's file: the temperatures and held-out counts
    calibration = report["calibration"]
    held_out = sum(written["held_out_samples"])
    assert held_out > 0
    temperatures = ", ".join(f"{t:.3f}" for t in written["temperatures"])
    line = (f"Confidence calibration written to `{cal}`: temperatures per position [{temperatures}]; "
            f"ECE pooled over the {held_out} held-out samples (every second prompt of each workload): "
            f"{calibration['pooled_ece_before']:.4f} before, {calibration['pooled_ece_after']:.4f} after.")
    assert line in text.splitlines(), text
    # without --calibrate there is no such line
    (tmp_path / "plain").mkdir()
    plain, _ = _eval(recipe_path, tiny_export, tmp_path / "plain", "--no-estimate")
    assert "Confidence calibration" not in plain


def _all_current(monkeypatch, paths, *, export_checked: bool) -> list:
    """Reports in both evaluation folders and every later stage current; the stages that run
    are recorded (none may evaluate)."""
    for folder, methods in ((paths.eval_dir, {"dspark": 1.5, "ngram": 1.1, "none": 1.0}),
                            (paths.dflash_eval_dir, {"dspark": 1.2, "none": 1.0})):  # fmt: skip
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "report.json").write_text(json.dumps(_report({"humaneval": 8}, methods)))
    ran = []
    monkeypatch.setattr(demo, "run_stage", lambda name, args, **kw: ran.append(name))
    monkeypatch.setattr(demo, "run_side_by_side", lambda *a, **kw: pytest.fail("an evaluation ran"))
    monkeypatch.setattr(demo, "eval_is_current", lambda *a, **kw: True)
    monkeypatch.setattr(demo, "model_card_is_current", lambda *a, **kw: True)
    monkeypatch.setattr(demo, "evaluations_side_by_side", lambda threads=1: False)
    if not export_checked:
        monkeypatch.setattr(demo, "export_is_current", lambda *a, **kw: True)
    return ran


def test_an_export_folder_under_home_is_skipped_once_made_and_named_openable(tmp_path, monkeypatch, capsys):
    """export.out_dir '~/drafts/x': draftforge export writes under the home folder, but the demo
    looked for a folder literally named '~' in the working directory, so it exported (and then
    evaluated) again on every rerun, and its last line gave a path no script could open."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    recipe = tiny_recipe(tmp_path, steps=4, overrides={"export.out_dir": "~/drafts/x", "eval.workloads": ["humaneval"]})
    cfg = load_recipe(recipe)
    paths = demo.demo_paths(cfg)
    assert paths.export_dir == home / "drafts" / "x"
    _finished_run(paths.run_dir, cfg.to_yaml())
    _finished_run(paths.dflash_dir, load_recipe(recipe, demo.dflash_overrides(paths)).to_yaml())
    # the export stage as an earlier demo ran it: the folder, then the stamp naming its command
    (home / "drafts" / "x").mkdir(parents=True)
    (home / "drafts" / "x" / "config.json").write_text('{"architectures": ["Qwen3DSparkModel"]}')
    command = ["export", str(paths.run_dir), "--recipe", str(paths.run_dir / demo_state.EXPORT_RECIPE),
               "--out", str(home / "drafts" / "x"),
               "--arch", cfg.export.arch, "--max-shard-size-mb", str(cfg.export.max_shard_size_mb)]  # fmt: skip
    (paths.run_dir / demo_state.EXPORT_STAMP).write_text(json.dumps({"command": command}))
    ran = _all_current(monkeypatch, paths, export_checked=True)
    monkeypatch.chdir(tmp_path)  # where a literal '~' folder would be looked for

    assert demo.main([str(recipe), "--num-prompts", "8"]) == 0
    out = capsys.readouterr().out
    assert ran == [], out  # the export is this one: not made again
    assert f"skipped: {home / 'drafts' / 'x'} is this export of" in out
    assert out.strip().splitlines()[-1].startswith(f"export_dir={home / 'drafts' / 'x'} al_dspark=1.500 ")
    assert not (tmp_path / "~").exists()


def test_a_recipe_without_regeneration_is_timed_as_the_whole_demo(tmp_path, monkeypatch, capsys):
    """data.regenerate false: stage 1 has nothing to do, and a first demo that ran every other
    stage said 'not the whole demo's time: 1 of 6 stages were skipped, done by an earlier run'."""
    recipe = tiny_recipe(tmp_path, steps=4, overrides={"eval.workloads": ["humaneval"]})
    cfg = load_recipe(recipe)
    assert not cfg.data.regenerate
    paths = demo.demo_paths(cfg)
    ran = []

    def run_stage(name, args, **kw):  # the trainings leave their final checkpoint
        ran.append(name)
        if args[0] == "train":
            dflash = any(a.startswith("train.output_dir=") for a in args)
            run_dir = paths.dflash_dir if dflash else paths.run_dir
            _finished_run(run_dir, load_recipe(recipe, list(args[2:])).to_yaml())
        # the export prints the digest of the folder it wrote (none here)
        return [f"export_files={export_digest(paths.export_dir)}"]

    def run_side_by_side(jobs, log_dir, *, parallel):
        for folder, methods in ((paths.eval_dir, {"dspark": 1.5, "ngram": 1.1, "none": 1.0}),
                                (paths.dflash_eval_dir, {"dspark": 1.2, "none": 1.0})):  # fmt: skip
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "report.json").write_text(json.dumps(_report({"humaneval": 8}, methods)))

    monkeypatch.setattr(demo, "run_stage", run_stage)
    monkeypatch.setattr(demo, "run_side_by_side", run_side_by_side)
    monkeypatch.setattr(demo, "evaluations_side_by_side", lambda threads=1: False)

    assert demo.main([str(recipe), "--num-prompts", "8"]) == 0
    out = capsys.readouterr().out
    assert ran == ["train DSpark", "train DFlash", "export", "export (model card)"], ran
    assert "skipped: data.regenerate is false" in out
    assert "; whole demo " in out and "not the whole demo's time" not in out
    assert "(this run so far:" not in out and "(demo so far:" in out
    # a rerun is still told apart: the stages done before are counted, the one with nothing to do is not
    monkeypatch.setattr(demo, "model_card_is_current", lambda *a, **kw: True)
    monkeypatch.setattr(demo, "eval_is_current", lambda *a, **kw: True)
    monkeypatch.setattr(demo, "export_is_current", lambda *a, **kw: True)
    assert demo.main([str(recipe), "--num-prompts", "8"]) == 0
    assert "not the whole demo's time: 4 of 6 stages were skipped, done by an earlier run" in capsys.readouterr().out


def test_the_acceptance_plot_of_a_run_without_rounds_keeps_its_scale_and_labels(tmp_path, monkeypatch):
    """Every prompt ended at its first token: no bar, and the plot's y axis spanned 4.8 to 5.2
    about the ceiling line, with the workload's label at the plot's right edge."""
    from draftforge.eval import report
    from draftforge.eval.harness import WorkloadResult, summarize
    from draftforge.eval.speculative import DecodeResult

    figures = {}

    def keep(fig, path):
        ax = fig.axes[0]
        figures[path.name] = (ax.get_ylim(), ax.get_xlim(), list(ax.get_xticks()))
        return path

    monkeypatch.setattr(report, "_save", keep)

    decoded = [DecodeResult(prompt_len=3, tokens=[5], rounds=[], wall_s=0.01)]  # ended at its first token
    empty = WorkloadResult(name="a", num_prompts=1)
    empty.methods = {m: summarize(decoded, 4) for m in ("none", "dspark", "ngram")}
    assert empty.methods["dspark"]["rounds"] == 0
    report.plot([empty], tmp_path, block_size=4)
    ylim, xlim, ticks = figures["acceptance_length.png"]
    assert ylim[0] == 0 and ylim[1] >= 5  # from 0, the ceiling (block + 1) in view
    assert all(xlim[0] < t < xlim[1] for t in ticks)
    # the label sits in the middle of where the workload's bars go
    assert (ticks[0] - xlim[0]) == pytest.approx(xlim[1] - ticks[0])


def test_eval_llamacpp_refuses_a_work_dir_that_is_a_file_before_anything_runs(tmp_path, monkeypatch):
    """--work-dir naming a file: refused only after the llama.cpp build and the target's
    conversion, by a FileExistsError traceback from mkdir."""
    from draftforge.eval import llamacpp_check

    taken = tmp_path / "gguf"
    taken.write_text("not a folder")
    monkeypatch.setattr("draftforge.eval.llamacpp.fetch_source", lambda *a, **kw: pytest.fail("fetched"))
    monkeypatch.setattr("draftforge.eval.llamacpp.build_tools", lambda *a, **kw: pytest.fail("built"))
    with pytest.raises(InputError, match=f"--work-dir {taken}: {taken} is a file, not a folder"):
        llamacpp_check.main([str(tmp_path / "export"), "--recipe", "none.yaml", "--work-dir", str(taken)])
    with pytest.raises(InputError, match=f"--work-dir {taken / 'sub'}: {taken} is a file, not a folder"):
        llamacpp_check.main([str(tmp_path / "export"), "--recipe", "none.yaml", "--work-dir", str(taken / "sub")])
