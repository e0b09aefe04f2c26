"""Eval report, round 12: the rows of the method key ``dspark`` say which draft they measured
(the DFlash ablation's report read 'dspark' with nothing telling it apart)."""

from __future__ import annotations

import json
from dataclasses import replace

from dspark_helpers import tiny_draft
from test_evalcli_r11 import _prompts_file, recipe_path, tiny_export  # noqa: F401  (fixtures)

from draftforge.eval.harness import WorkloadResult
from draftforge.eval.report import draft_kind, markdown_table


def test_draft_kind_tells_dspark_from_the_dflash_ablation():
    cfg = tiny_draft(seed=0).config
    assert cfg.markov_rank > 0 and cfg.enable_confidence_head
    assert draft_kind(cfg) == (f"a DSpark draft (block {cfg.block_size}, {cfg.markov_head_type} Markov head "
                               f"of rank {cfg.markov_rank}, confidence head)")
    dflash = replace(cfg, markov_rank=0, enable_confidence_head=False)
    assert draft_kind(dflash) == f"a draft without a Markov head (DFlash-style; block {cfg.block_size}, no confidence head)"


def test_the_table_names_the_draft_only_when_told(monkeypatch):
    monkeypatch.setattr("draftforge.eval.report.uncertainty_lines", lambda u: [])  # no rounds here
    results = [WorkloadResult(name="a", num_prompts=0)]
    told = markdown_table(results, block_size=4, intervals={}, draft="a draft X")
    assert "The `dspark` rows measure the draft under test: a draft X." in told.splitlines()
    assert "measure the draft under test" not in markdown_table(results, block_size=4, intervals={})


def test_eval_writes_the_drafts_kind_into_both_reports(recipe_path, tiny_export, tmp_path):
    from draftforge.eval.cli import main
    from draftforge.train.hf_load import config_from_serving, read_serving_config

    out = tmp_path / "r"
    assert main([str(tiny_export), "--recipe", str(recipe_path), "--prompts-file",
                 str(_prompts_file(tmp_path, ["alpha"])), "--max-new-tokens", "6", "--out", str(out),
                 "--no-estimate", "--baselines", "none"]) == 0  # fmt: skip
    cfg = config_from_serving(read_serving_config(tiny_export))
    report = json.loads((out / "report.json").read_text())
    assert report["draft_kind"] == draft_kind(cfg)
    assert f"The `dspark` rows measure the draft under test: {draft_kind(cfg)}." in (out / "report.md").read_text()
