"""Review round 11, seeds: a seed out of range is refused where it is given, before any work.

``eval --seed`` derives one generator seed per prompt (then ``seed * 1_000_003 + index``), which
torch refused above 2**64 only after the target had loaded and the first workload had started;
a recipe's seed the same way at its first use. Every seed is now 0..2**32-1, and the largest
one works where seeds are derived from it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from eval_helpers import random_prompts, tiny_eval_draft, tiny_target

from draftforge.argtypes import MAX_SEED
from draftforge.cli import main
from draftforge.config import RecipeError, load_recipe
from draftforge.eval.harness import EvalSettings, run_workload

TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"


def test_eval_refuses_a_seed_out_of_range_before_loading_anything(tmp_path, capsys):
    for bad in (str(MAX_SEED + 1), "-1"):
        with pytest.raises(SystemExit) as info:  # the draft folder does not even exist
            main(["eval", str(tmp_path / "no-export"), "--seed", bad])
        assert info.value.code == 2
        assert f"argument --seed: must be a seed, 0..4294967295, got {bad}" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["eval.seed", "train.seed", "target.seed", "target.generation.seed", "data.shuffle_seed"])
def test_a_recipe_seed_out_of_range_is_refused_with_its_key(key):
    assert load_recipe(TINY, [f"{key}={MAX_SEED}"])  # the largest is a seed
    for bad in (MAX_SEED + 1, -1):
        with pytest.raises(RecipeError, match=rf"{key}=.*less than or equal to {MAX_SEED}|"
                                              rf"{key}=.*greater than or equal to 0"):
            load_recipe(TINY, [f"{key}={bad}"])


def test_the_largest_seed_samples_every_prompt():
    """Sampled decoding seeds each prompt's generator from the seed: at MAX_SEED too."""
    target = tiny_target()
    draft = tiny_eval_draft(target)
    result = run_workload(
        "random", random_prompts(3), draft, target,
        EvalSettings(max_new_tokens=6, temperature=1.0, seed=MAX_SEED, estimate=True, estimate_anchors=4),
        progress=lambda _: None,
    )  # fmt: skip
    assert result.methods["dspark"]["tokens"] == 18
    torch.Generator().manual_seed(MAX_SEED * 1000 + 255)  # train's per-rank seed, 256 ranks
