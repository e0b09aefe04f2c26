"""YAML a run wrote is read back as recipes are: a crafted one cannot make a resume hang.

A security review wrote a checkpoint's ``recipe.yaml`` of 673 bytes whose aliases of aliases
stand for 10**7 values: ``resume_note``, which every resume runs, took 118 s and built a note
of 440 MB (``yaml.safe_load`` keeps the aliases; the comparison walks every path). The demo's
reads of a run's ``config.yaml`` had the same shape.
"""

from __future__ import annotations

import time

import pytest

from draftforge.recipe_errors import RecipeError
from draftforge.recipe_yaml import MAX_EXPANDED_VALUES, read_yaml
from draftforge.train.recipe_changes import resume_note


def bomb(levels: int, width: int = 10) -> str:
    """Each level is a mapping of ``width`` aliases of the level below: width**(levels+1) values."""
    lines = ["l0: &l0 {" + ", ".join(f"k{i}: 1" for i in range(width)) + "}"]
    for n in range(1, levels + 1):
        lines.append(f"l{n}: &l{n} {{" + ", ".join(f"k{i}: *l{n - 1}" for i in range(width)) + "}")
    return "\n".join(lines) + "\n"


def test_a_checkpoints_recipe_of_aliases_of_aliases_is_refused_not_expanded(tmp_path):
    (tmp_path / "recipe.yaml").write_text(bomb(6))  # 10**7 values in under 700 bytes
    began = time.monotonic()
    note = resume_note(tmp_path, "train: {steps: 3}\n", next_step=1)
    assert time.monotonic() - began < 5  # 118 s before (the refusal itself takes milliseconds)
    assert note.startswith(f"{tmp_path / 'recipe.yaml'} could not be read to compare recipes (RecipeError: ")
    assert f"past {MAX_EXPANDED_VALUES} values" in note and len(note) < 2000


def test_a_plain_saved_recipe_still_compares_key_by_key(tmp_path):
    (tmp_path / "recipe.yaml").write_text("train:\n  steps: 3\n  max_grad_norm: 1.0e-3\ndraft:\n  block_size: 8\n")
    note = resume_note(tmp_path, "train:\n  steps: 3\n  max_grad_norm: 2.0e-3\ndraft:\n  block_size: 4\n",
                       next_step=4)
    assert "in what is trained: draft.block_size: 8 -> 4; train.max_grad_norm: 0.001 -> 0.002." in note


def test_read_yaml_refuses_a_cycle_and_reads_what_safe_load_reads_otherwise():
    with pytest.raises(RecipeError, match="config.yaml"):
        read_yaml("a: &x [*x]\n", "config.yaml")
    assert read_yaml("a: [1, 2]\nb: {c: x}\n", "config.yaml") == {"a": [1, 2], "b": {"c": "x"}}
