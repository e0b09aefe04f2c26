"""Session 50: sizes too large to build are refused as recipe errors, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftforge.config import load_recipe
from draftforge.recipe_errors import RecipeError

TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"


@pytest.mark.parametrize("override,bound", [
    ("draft.intermediate_size=99999999999999999999999", 1 << 20),
    ("draft.markov_rank=99999999999999999999999", 65536),
    ("draft.num_hidden_layers=99999999999999999999999", 256),
    ("target.shape.num_hidden_layers=100000", 4096),
])
def test_a_size_too_large_to_build_is_a_recipe_error(override, bound):
    """A huge intermediate_size or markov_rank passed the recipe check and failed in the dry run
    with torch's 'Overflow when unpacking long long' traceback (exit 1); a huge layer count made
    the dry run build layers for minutes."""
    key = override.split("=")[0]
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, [override])
    assert f"command line {override!r}: {key}: must be less than or equal to {bound}" in str(info.value)


def test_problems_of_the_split_point_at_the_override_that_caused_them():
    """'split.comm_backend=nccl' on a machine without GPUs, and trainer ranks beyond the world
    given on the command line, were blamed on the recipe file's 'split:' line."""
    from draftforge.splitserve.roles import split_problems

    cfg = load_recipe(TINY, ["split.comm_backend=nccl"])
    problems = [cfg.locate(p) for p in split_problems(cfg, cuda_devices=0)]
    assert any(p.startswith("command line 'split.comm_backend=nccl': split.comm_backend: comm_backend "
                            "nccl needs CUDA GPUs and none is visible; remove it") for p in problems), problems
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, ["split.trainer_ranks=[3]"])
    assert "command line 'split.trainer_ranks=[3]': split.world_size: 2: target_ranks and trainer_ranks" in str(
        info.value)


@pytest.mark.parametrize("text,message", [
    ("name: x\ndraft:\n  markov_rank: 8\n  steps=20\n  block_size: 4\n",
     "r.yaml:4: YAML syntax error: while scanning a simple key: could not find expected ':'"),
    ("name: x\ndraft:\n  steps=20\n  markov_rank: 8\n",
     "r.yaml:4: YAML syntax error: mapping values are not allowed here (line 3 ('steps=20') is no "
     "'key: value' pair, so YAML reads it as text going on into this line)"),
    ("name: x\ndraft:\n  block_size:\u00a04\n  markov_rank: 8\n",
     "line 3 holds a non-breaking space (U+00A0) at column 14, which YAML does not read as a space"),
    ("name: x\ndraft:\n\tblock_size: 4\n",
     "r.yaml:3: YAML syntax error: while scanning for the next token: found character '\\t' that cannot "
     "start any token (a tab at column 1: YAML indents with spaces, not tabs)"),
])
def test_yaml_syntax_errors_point_at_the_line_and_say_what_it_usually_means(tmp_path, text, message):
    """'steps=20' was reported one line late (where PyYAML noticed), and a non-breaking space or
    a tab were left to PyYAML's words, which do not name them."""
    path = tmp_path / "r.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert message in str(info.value)


@pytest.mark.parametrize("override,message", [
    ("train.output_dir=''", "command line \"train.output_dir=''\": train.output_dir: is empty: give the "
                            "run directory's path"),
    ("data.regenerated_file=''", "data.regenerated_file: is empty: give a .jsonl path"),
    ("data.train_files=['']", "data.train_files: holds an empty path"),
])
def test_an_empty_path_is_refused_where_it_was_given(override, message):
    """train.output_dir='' was accepted (training would write into the current directory), and
    an empty data path was reported as '.: no such file' or 'not a file: ' with a blank name."""
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, [override])
    assert message in str(info.value)
