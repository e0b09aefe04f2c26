"""``draftforge demo``'s decisions without running its stages: the evaluation commands, the
paired table's refusals, what --skip-train --force keeps, the machine line, the model card."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from splitserve_helpers import tiny_recipe

from draftforge.config import load_recipe
from draftforge.eval import demo, demo_report, demo_stages, demo_state


def _report(verify: str, methods: dict) -> dict:
    return {
        "target": "t", "target_config": {"dtype": "float32", "backend": "hf"},
        "settings": {"temperature": 0.0, "max_new_tokens": 8, "verify": verify, "threshold": 0.5, "seed": 0},
        "block_size": 4,
        "workloads": {"gsm8k": {"num_prompts": 8, "prompt_digest": "abc", "methods": methods}},
    }  # fmt: skip


def _method(al_per_prompt: float) -> dict:
    rounds = [10] * 8
    return {"acceptance_length": al_per_prompt, "prompt_rounds": rounds,
            "prompt_al_sum": [al_per_prompt * r for r in rounds]}  # fmt: skip


def test_both_evaluations_verify_in_full_beside_the_tabulated_baselines_whatever_the_recipe_says(tmp_path):
    """A recipe's eval.verify threshold went to DSpark's evaluation only (DFlash was forced to
    full), so the DSpark - DFlash row compared threshold with full verification; a recipe
    without the n-gram baseline left the table's n-gram column empty."""
    from draftforge.eval.cli import build_parser

    recipe = tiny_recipe(tmp_path, overrides={"eval.verify": "threshold", "eval.baselines": ["none"]})
    cfg = load_recipe(recipe)
    assert (cfg.eval.verify, list(cfg.eval.baselines)) == ("threshold", ["none"])
    dspark, dflash = demo.evaluation_commands(str(recipe), demo.demo_paths(cfg), workloads=["gsm8k"],
                                              num_prompts=2, max_new_tokens=8)  # fmt: skip
    # what draftforge eval makes of them: its own parser, the recipe's value where a flag is absent
    dspark_args, dflash_args = (build_parser().parse_args(argv[1:]) for argv in (dspark, dflash))
    assert dspark_args.draft == str(tmp_path / "run" / "export")
    assert dflash_args.draft == str(tmp_path / "run-dflash")
    assert dspark_args.verify == dflash_args.verify == "full"
    assert dspark_args.baselines == ["none", "ngram"] and dflash_args.baselines == ["none"]
    for option in ("recipe", "dtype", "temperature", "workloads", "num_prompts", "max_new_tokens"):
        assert getattr(dspark_args, option) == getattr(dflash_args, option), option


def test_the_paired_table_refuses_what_eval_compare_refuses_one_comparison_at_a_time():
    """DSpark evaluated with threshold verification, DFlash in full: the table gave the
    difference a verdict where ``draftforge eval compare`` refuses the pair."""
    from draftforge.errors import InputError
    from draftforge.eval.compare import check_same_decoding

    ds = (Path("run/eval/report.json"), _report("threshold", {"dspark": _method(1.5), "ngram": _method(1.2),
                                                               "none": _method(1.0)}))
    df = (Path("run/eval-dflash/report.json"), _report("full", {"dspark": _method(1.6)}))
    with pytest.raises(InputError) as refusal:
        check_same_decoding(ds, "dspark", df, "dspark")
    table = demo_report.lead_table(ds, df)
    assert "| DSpark - n-gram | +0.30 (+0.30 to +0.30) | +0.30 (+0.30 to +0.30) | ahead |" in table
    assert "| DSpark - DFlash |" not in table and "behind" not in table
    assert table.endswith(f"\n\n(No intervals for DSpark - DFlash: {refusal.value}.)")
    # decoded alike: both rows
    df_full = (df[0], _report("threshold", {"dspark": _method(1.6)}))
    assert "| DSpark - DFlash | -0.10 (-0.10 to -0.10) | -0.10 (-0.10 to -0.10) | behind |" in (
        demo_report.lead_table(ds, df_full))
    # a report without the n-gram baseline loses that row only (one try held both)
    no_ngram = (ds[0], _report("threshold", {"dspark": _method(1.5), "none": _method(1.0)}))
    table = demo_report.lead_table(no_ngram, df_full)
    assert "| DSpark - DFlash | -0.10" in table and "| DSpark - n-gram |" not in table
    assert "(No intervals for DSpark - n-gram: run/eval/report.json: workload 'gsm8k' has no method 'ngram'" in table
    # neither: the two refusals alone
    table = demo_report.lead_table(no_ngram, df)
    assert table.startswith("(No intervals for DSpark - n-gram:") and "| comparison |" not in table
    assert "\n\n(No intervals for DSpark - DFlash:" in table


def _trained_run(recipe: Path, trained_with: list[str]) -> Path:
    """A finished run of ``recipe`` with ``trained_with`` overrides, its export and evaluations."""
    run = recipe.parent / "run"
    checkpoint = run / "checkpoints" / "step_00000004"
    checkpoint.mkdir(parents=True)
    for name in ("COMPLETE", "trainer_state.json"):
        (checkpoint / name).write_text("{}")
    (run / "config.yaml").write_text(load_recipe(recipe, trained_with).to_yaml())
    for folder in ("export", "eval", "eval-dflash"):
        (run / folder).mkdir()
        (run / folder / "keep.txt").write_text("x")
    return run


def test_skip_train_force_refuses_another_recipes_run_before_deleting_anything(tmp_path, capsys):
    """--skip-train --force deleted the export and both evaluations, then refused the run as
    another recipe's, advising --force again."""
    recipe = tiny_recipe(tmp_path, steps=4)
    _trained_run(recipe, ["train.lr=0.001"])  # the recipe says 3e-3 now
    assert demo.main([str(recipe), "--skip-train", "--force"]) == 2
    err = capsys.readouterr().err
    assert "holds a DSpark run of a different recipe" in err and "'lr: 0.001'" in err
    assert ("--skip-train uses the runs as they are: undo the edit, or drop --skip-train and pass "
            "--retrain (or --force to start over).") in err
    assert "Rerun with" not in err
    for folder in ("export", "eval", "eval-dflash"):
        assert (tmp_path / "run" / folder / "keep.txt").is_file(), folder
    # without --skip-train, --retrain and --force are the fixes it names (--force deletes the run)
    with pytest.raises(demo.DemoError, match="Rerun with --retrain to train it again on the same answers, or "
                                             "--force to train again from scratch"):
        demo_state.check_same_recipe(tmp_path / "run", load_recipe(recipe).to_yaml(), "DSpark")


def test_skip_train_force_refuses_a_run_trained_on_other_answers_before_deleting_anything(tmp_path, capsys):
    recipe = tiny_recipe(tmp_path, steps=4, overrides={"data.regenerate": True})
    cfg = load_recipe(recipe)
    run = _trained_run(recipe, demo.dspark_overrides(cfg, demo.demo_paths(cfg), "bigram")[0])  # this recipe's
    (run / "regenerated.jsonl").write_text("answers written again\n")
    (run / demo_state.ANSWERS_STAMP).write_text(json.dumps({"sha256": "the answers it trained on"}))
    assert demo.main([str(recipe), "--skip-train", "--force"]) == 2
    err = capsys.readouterr().err
    assert "the DSpark draft was trained on other answers" in err
    assert ("--skip-train uses the runs as they are: drop --skip-train and pass --retrain to train it on these "
            "answers (or --force to start over)") in err
    assert "rerun the demo with" not in err
    for folder in ("export", "eval", "eval-dflash"):
        assert (run / folder / "keep.txt").is_file(), folder


def test_the_machine_line_says_where_the_evaluations_ran(monkeypatch):
    """demo.md said 'no GPU used' although draftforge eval --device auto takes a visible GPU."""
    from draftforge.config import load_recipe as load

    root = Path(__file__).resolve().parents[1]
    cfg = load(root / "recipes" / "tiny-debug.yaml")
    paths = demo.demo_paths(cfg.model_copy(update={"train": cfg.train.model_copy(
        update={"output_dir": "/nonexistent/run"})}))
    monkeypatch.setattr(demo_report, "measured_when", lambda *stamps: "then")  # no reports here

    def machine(*reports):
        text = demo_report.demo_markdown("TABLE", command="c", cfg=cfg, paths=paths, num_prompts=2, max_new_tokens=8,
                                  block_size=4, devices=demo_report.recorded_devices(*reports))  # fmt: skip
        return next(line.rstrip() for line in text.splitlines() if line.startswith("Measured: "))

    on_gpu = machine({"device": "cuda:0", "target_devices": ["cuda:0"]}, {"device": "cuda:0"})
    assert on_gpu.endswith(", evaluated on cuda:0.") and "no GPU" not in on_gpu
    spread = machine({"device": "cuda:0", "target_devices": ["cuda:0", "cuda:1"]}, {"device": "cuda:0"})
    assert spread.endswith(", evaluated on cuda:0, cuda:1.")
    assert machine({"device": "cpu", "target_devices": ["cpu"]}, {"device": "cpu"}).endswith(
        ", evaluated on the CPU, no GPU used.")
    assert machine({}, {}).endswith(", the evaluations' device not recorded.")


@pytest.mark.parametrize("cores,gpu,threads,side_by_side", [
    (2, False, 1, True), (16, True, 1, False), (1, False, 1, False),
    (2, False, 2, False), (4, False, 2, True), (3, False, 2, False)])
def test_the_evaluations_share_a_gpu_one_after_the_other(monkeypatch, cores, gpu, threads, side_by_side):
    """Side by side only where the cores hold both at the recipe's target.num_threads each
    (which draftforge eval sets, over the demo's OMP_NUM_THREADS=1) and no GPU is shared."""
    monkeypatch.setattr(demo_stages, "usable_cores", lambda: cores)
    monkeypatch.setattr(demo_stages, "_cuda_visible", lambda: gpu)
    assert demo_stages.evaluations_side_by_side(threads) is side_by_side


def test_a_report_md_newer_than_its_report_json_does_not_go_into_the_model_card(tmp_path):
    """An evaluation interrupted while plotting left a new report.md beside the old
    report.json; the demo re-exported the card from it, a table demo.md does not show."""
    cfg = load_recipe(tiny_recipe(tmp_path))
    paths = demo.demo_paths(cfg)
    for path in (paths.eval_dir / "report.json", paths.export_dir / "README.md", paths.eval_dir / "report.md"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    stamp = 1_700_000_000
    for offset, path in enumerate((paths.eval_dir / "report.json", paths.export_dir / "README.md",
                                   paths.eval_dir / "report.md")):  # fmt: skip
        os.utime(path, (stamp + offset, stamp + offset))
    assert demo_state.model_card_is_current(paths)
    os.utime(paths.eval_dir / "report.json", (stamp + 5, stamp + 5))  # a finished evaluation since
    assert not demo_state.model_card_is_current(paths)


def test_an_evaluation_interrupted_while_plotting_leaves_the_old_reports(tmp_path, monkeypatch):
    """report.md was written before the plots: a failure there left a new report.md beside the
    old report.json. Now the plots come first, then report.md, then report.json."""
    from draftforge.eval import report
    from draftforge.eval.harness import WorkloadResult

    results = [WorkloadResult(name="gsm8k", num_prompts=1, methods={"none": _method(1.0)})]
    monkeypatch.setattr(report, "uncertainty", lambda results: {})
    monkeypatch.setattr(report, "markdown_table", lambda *a, **kw: "NEW TABLE")
    for name in ("report.md", "report.json"):
        (tmp_path / name).write_text("old")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "plot", interrupted)
    with pytest.raises(KeyboardInterrupt):
        report.write_report(results, tmp_path, {"command": "c"}, block_size=4)
    assert (tmp_path / "report.md").read_text() == (tmp_path / "report.json").read_text() == "old"

    written = []
    monkeypatch.setattr(report, "plot", lambda *a, **kw: written.append("plots") or [])
    real = report.write_atomic_all
    monkeypatch.setattr(report, "write_atomic_all", lambda items: written.extend(p.name for p, _ in items) or real(items))
    report.write_report(results, tmp_path, {"command": "c"}, block_size=4)
    assert written == ["plots", "report.md", "report.json"]  # renamed into place in this order
    assert (tmp_path / "report.md").read_text() == "NEW TABLE"
    assert json.loads((tmp_path / "report.json").read_text())["command"] == "c"
