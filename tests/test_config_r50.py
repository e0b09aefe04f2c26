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
