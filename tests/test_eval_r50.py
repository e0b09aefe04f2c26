"""Session 50: the evaluator checks prompts against the target's context as well as the draft's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from eval_helpers import random_prompts, tiny_eval_draft, tiny_target

from draftforge.config import load_recipe
from draftforge.errors import InputError
from draftforge.eval.harness import EvalSettings, run_workload
from draftforge.splitserve.target import build_target
from draftforge.train.export import export_draft

TINY_DEBUG = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"


def _recipe_with_short_target(tmp_path, context: int) -> Path:
    """tiny-debug with the eval helpers' vocabulary and a target whose context is ``context``
    positions (the draft keeps its own, longer one)."""
    text = re.sub(r"vocab_size: 49152.*", f"vocab_size: 512\n    max_position_embeddings: {context}",
                  TINY_DEBUG.read_text())
    text = text.replace("max_length: 128", f"max_length: {context}")  # the recipe checks training's
    path = tmp_path / "tiny-short.yaml"
    path.write_text(text)
    return path


def test_a_prompt_past_the_targets_context_is_refused_before_decoding(tmp_path):
    """The draft's max_position_embeddings was checked, the target's not: a target with a
    shorter context than its draft decoded past it (a learned-position target fails deep
    inside decoding; a RoPE one answers from positions it never saw)."""
    from draftforge.eval.cli import main

    recipe_path = _recipe_with_short_target(tmp_path, 16)
    recipe = load_recipe(recipe_path)
    target = build_target(recipe.target, recipe.draft.target_layer_ids)
    assert target.model.config.max_position_embeddings == 16
    draft = tiny_eval_draft(target)
    assert draft.config.max_position_embeddings > 16 + 10  # the draft's own limit passes
    export_dir = export_draft(draft, tmp_path / "export", progress=lambda _: None)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"workload": "w", "input_ids": random_prompts(1)[0]}) + "\n")
    argv = [str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
            "--out", str(tmp_path / "r"), "--no-estimate", "--device", "cpu"]
    with pytest.raises(InputError, match=re.escape(
            f"{prompts}:1: 10 prompt tokens + --max-new-tokens 7 exceed the target's "
            "max_position_embeddings 16")):
        main(argv + ["--max-new-tokens", "7"])
    assert not (tmp_path / "r").exists()
    assert main(argv + ["--max-new-tokens", "6"]) == 0  # 16 positions fit exactly


def test_run_workload_checks_the_targets_context_too():
    target = tiny_target()
    target.model.config.max_position_embeddings = 12
    draft = tiny_eval_draft(target)
    with pytest.raises(InputError, match="workload 'w', prompt 0: 10 prompt tokens \\+ max_new_tokens 3 "
                                         "exceed the target's max_position_embeddings 12"):
        run_workload("w", random_prompts(1), draft, target, EvalSettings(max_new_tokens=3, estimate=False))
