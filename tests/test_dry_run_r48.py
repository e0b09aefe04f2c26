"""The dry run's trainer estimate counts the objective's joined [lm_head | W2] head and W2's
fp32 gradient (found missing by a review in session 48)."""

from pathlib import Path

import torch

from draftforge.config import load_recipe

ROOT = Path(__file__).resolve().parents[1]


def _items(cfg):
    from draftforge.splitserve.dry_run import draft_parameter_counts, trainer_estimate

    with_emb, without = draft_parameter_counts(cfg)
    return {name.split(" (")[0]: value for name, value in trainer_estimate(cfg, with_emb, without).items}


def test_the_joined_head_and_w2_gradient_are_counted_by_hand():
    """recipes/smollm2-cpu.yaml: 49,152 tokens, target hidden 576, Markov rank 256, bf16:
    49,152 x 832 x 2 bytes for the head, 49,152 x 256 x 4 for W2's fp32 gradient; none of
    either without a Markov head."""
    cfg = load_recipe(ROOT / "recipes" / "smollm2-cpu.yaml", ["train.dtype=bfloat16"])
    items = _items(cfg)
    assert items["objective's joined [lm_head | W2]"] == 49_152 * 832 * 2 == 81_788_928
    assert items["objective's W2 gradient"] == 49_152 * 256 * 4
    plain = _items(load_recipe(ROOT / "recipes" / "smollm2-cpu.yaml",
                               ["train.dtype=bfloat16", "draft.markov_rank=0",
                                "draft.confidence_head_with_markov=false"]))
    assert not any(name.startswith("objective's joined") or name == "objective's W2 gradient" for name in plain)


def test_the_counted_head_is_the_one_the_objective_builds():
    """The item's shape and dtype against the matrix train/objective.py really joins."""
    from draftforge.train import objective

    lm_head = torch.randn(300, 24, dtype=torch.bfloat16)
    w2 = torch.randn(300, 8)
    head = objective._vocab_head(lm_head, w2)
    assert head.shape == (300, 24 + 8) and head.dtype == torch.bfloat16
    assert head.nbytes == 300 * (24 + 8) * 2
