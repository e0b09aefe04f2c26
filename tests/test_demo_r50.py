"""Session 50: demo.md says which machine and which code the evaluations measured."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _text(monkeypatch, reports, now="abc123"):
    from draftforge.config import load_recipe
    from draftforge.eval import demo, demo_report
    from draftforge.train import metrics

    cfg = load_recipe(ROOT / "recipes" / "tiny-debug.yaml")
    paths = demo.demo_paths(cfg.model_copy(update={"train": cfg.train.model_copy(
        update={"output_dir": "/nonexistent/run"})}))
    monkeypatch.setattr(demo_report, "measured_when", lambda *stamps: "then")
    monkeypatch.setattr(metrics, "git_revision", lambda source=None: now)
    return demo_report.demo_markdown("TABLE", command="c", cfg=cfg, paths=paths, num_prompts=2,
                                     max_new_tokens=8, block_size=4, devices=["cpu"], reports=reports)


def test_the_table_names_the_machine_and_code_the_evaluations_recorded(monkeypatch):
    """A rerun that finds every stage done prints the table measured then: after a pull, or on
    another machine, it showed the old figures under this machine's description and without
    a word about the code that produced them."""
    recorded = [{"host": "2 cores (Xeon X, native bf16: amx_bf16), Linux", "draftforge_revision": "abc123"}] * 2
    text = _text(monkeypatch, recorded)
    assert "machine: 2 cores (Xeon X, native bf16: amx_bf16), Linux, evaluated on the CPU" in text
    assert "Code: draftforge abc123." in text

    moved = _text(monkeypatch, recorded, now="def456")
    assert ("Code: draftforge def456; the evaluations ran at abc123: not this code's figures "
            "(`draftforge demo --force --skip-train` measures them again).") in moved

    older = _text(monkeypatch, [{}, {}])  # reports written before they recorded either
    assert "(this machine: the evaluations recorded none), evaluated on the CPU" in older
    assert "the evaluations ran at not recorded: not this code's figures" in older


def test_eval_records_its_host_and_revision(tmp_path):
    import json
    import re

    from eval_helpers import random_prompts, tiny_eval_draft

    from draftforge.config import load_recipe
    from draftforge.eval.cli import main
    from draftforge.eval.demo_report import host_description
    from draftforge.splitserve.target import build_target
    from draftforge.train.export import export_draft
    from draftforge.train.metrics import git_revision

    recipe_path = tmp_path / "tiny.yaml"
    recipe_path.write_text(re.sub(r"vocab_size: 49152.*", "vocab_size: 512",
                                  (ROOT / "recipes" / "tiny-debug.yaml").read_text()))
    recipe = load_recipe(recipe_path)
    target = build_target(recipe.target, recipe.draft.target_layer_ids)
    export_dir = export_draft(tiny_eval_draft(target), tmp_path / "export", progress=lambda _: None)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"workload": "w", "input_ids": random_prompts(1)[0]}) + "\n")
    assert main([str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
                 "--max-new-tokens", "4", "--out", str(tmp_path / "r"), "--no-estimate"]) == 0
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["host"] == host_description()
    assert report["draftforge_revision"] == git_revision()


def test_a_stop_while_force_deletes_says_to_rerun_with_force(monkeypatch, capsys):
    """The hint was fixed when the demo started: 'rerun without --force' also for a stop in the
    middle of --force's deletions, after which a rerun without it kept the earlier DFlash run
    beside a DSpark run trained anew."""
    import signal

    import pytest

    from draftforge.eval import demo
    from draftforge.splitserve.supervisor import JobInterrupted

    def stopped(args, command, *, deleted):
        args.forced = deleted  # run_demo sets it once every earlier output is deleted
        raise JobInterrupted(signal.SIGTERM)

    for deleted, said in [(False, "rerun the same command (with --force: the earlier outputs were not all "
                                   "deleted yet)"),
                          (True, demo.RERUN_WITHOUT_FORCE)]:
        monkeypatch.setattr(demo, "run_demo", lambda args, command, deleted=deleted: stopped(
            args, command, deleted=deleted))
        with pytest.raises(JobInterrupted):
            demo.main(["--force"])
        assert f"draftforge demo: stopped on SIGTERM; {said}" in capsys.readouterr().err


def test_a_run_without_an_answers_record_is_used_but_said(tmp_path, capsys):
    """A run trained by hand into the demo's folder (as the recipe's comments suggest) records
    no answers: the demo used it beside a DFlash run trained on other answers without a word."""
    from draftforge.eval.demo_state import check_trained_on

    check_trained_on(tmp_path, "abc", "DSpark")
    out = capsys.readouterr().out
    assert f"demo: note: {tmp_path} records no answers it trained on" in out
    assert "the DSpark draft is used unchecked; --force trains it again" in out
    check_trained_on(tmp_path, None, "DSpark")  # nothing to check against: nothing said
    assert capsys.readouterr().out == ""


def test_an_installed_copy_does_not_call_its_own_figures_another_codes(monkeypatch):
    """Outside a git checkout draftforge eval records no revision (None), and the table said
    'the evaluations ran at not recorded: not this code's figures' after every demo, a warning
    that measuring again could not clear."""
    installed = [{"draftforge_revision": None}] * 2
    assert "Code: draftforge installed copy (no git revision)." in _text(monkeypatch, installed, now=None)
    # a checkout's table from an installed copy's evaluations, and the reverse, still say so
    assert "the evaluations ran at an installed copy: not this code's" in _text(monkeypatch, installed)
    checkout = [{"draftforge_revision": "abc123"}] * 2
    assert "the evaluations ran at abc123: not this code's" in _text(monkeypatch, checkout, now=None)
