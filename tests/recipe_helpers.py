"""A valid tiny recipe for the recipe loader's tests, and the problems a load reports."""

from __future__ import annotations

import pytest

from draftforge.config import RecipeError, load_recipe

# Line numbers the tests expect are counted from its first line.
TINY_RECIPE = """\
target:
  model: random
  shape:
    num_hidden_layers: 4
    hidden_size: 64
    vocab_size: 512
    num_attention_heads: 4
    num_key_value_heads: 2
draft:
  hidden_size: 64
  num_attention_heads: 4
  num_key_value_heads: 2
  target_layer_ids: [0, 1, 2]
  block_size: 4
  mask_token_id: 3
  markov_rank: 16
train:
  strategy: single
"""


def problems(path, overrides=()) -> list[str]:
    """The problems loading the recipe at ``path`` reports (it must be refused)."""
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    return info.value.problems
