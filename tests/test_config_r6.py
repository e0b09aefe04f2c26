"""Review round 6 of the recipe loader and the dry run: placeholder defaults of target.shape
are never taken for the target's values, and empty nested sections mean their defaults."""

import json
from pathlib import Path

import pytest

from draftforge.config import RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[1]

# a local target folder whose config.json, like many, gives no rope_theta and no
# max_position_embeddings (transformers fills in its own defaults for them)
CONFIG = {"num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 49152, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 128}

RECIPE = """\
target:
  model: {model}
  shape:
{shape}
draft:
  hidden_size: 64
  num_attention_heads: 4
  num_key_value_heads: 2
  intermediate_size: 128
  target_layer_ids: [0, 1, 2]
  block_size: 4
  markov_rank: 16
data:
  max_length: 128
split:
  target_ranks: [0]
  trainer_ranks: [1]
train:
  strategy: single
  steps: 20
"""


def _recipe(tmp_path: Path, shape: dict) -> Path:
    model = tmp_path / "target"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    shape = {key: CONFIG[key] for key in ("num_hidden_layers", "hidden_size", "vocab_size")} | shape
    lines = "\n".join(f"    {key}: {value}" for key, value in shape.items())
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE.format(model=model, shape=lines))
    return path


def test_a_declared_shape_field_the_config_json_omits_is_used_not_refused(tmp_path):
    # the config gives neither, so the recipe's values are the only ones: they were refused as
    # "differs from the model's rope_theta 10000.0", the section's placeholder
    path = _recipe(tmp_path, {"rope_theta": 1000000.0, "max_position_embeddings": 32768})
    cfg = load_recipe(path)
    assert cfg.draft.rope_theta == 1000000.0
    assert cfg.draft.max_position_embeddings == 32768
    resolved = tmp_path / "resolved.yaml"  # what a run records, reloaded by export and eval
    resolved.write_text(cfg.to_yaml())
    assert load_recipe(resolved) == cfg


def test_a_declared_shape_field_the_config_json_gives_is_still_checked(tmp_path):
    path = _recipe(tmp_path, {"rope_theta": 1000000.0, "num_key_value_heads": 4,
                              "max_position_embeddings": 32768})
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert err.value.problems == [
        f"{path}:8: target.shape.num_key_value_heads: 4 differs from {tmp_path / 'target'}'s "
        "num_key_value_heads 2; remove it or fix it"
    ]


GIB = 1024**3


def test_the_target_estimate_does_not_size_activations_from_placeholder_heads():
    from draftforge.splitserve.dry_run import target_estimate

    recipe = ROOT / "recipes/ling3-flash-dspark.yaml"
    hf = ["target.backend=hf", "split.target_tensor_parallel=1"]
    # the recipe declares layers, hidden size, vocabulary and positions only: the section's
    # 4 heads, 2 key/value heads and MLP width 128 are not Ling's, so nothing is made of them
    items = dict(target_estimate(load_recipe(recipe, hf)).items)
    activations = [name for name in items if name.startswith("features: one layer's activations")]
    kv = [name for name in items if name.startswith("generation: KV cache + logits")]
    assert activations == ["features: one layer's activations (unknown, not counted: declare "
                           "target.shape.num_attention_heads, intermediate_size)"]
    assert kv == ["generation: KV cache + logits (unknown, not counted: declare "
                  "target.shape.num_attention_heads, num_key_value_heads)"]
    assert items[activations[0]] == items[kv[0]] == 0

    declared = [*hf, "target.shape.num_attention_heads=32", "target.shape.num_key_value_heads=4",
                "target.shape.intermediate_size=9216"]
    items = dict(target_estimate(load_recipe(recipe, declared)).items)
    # by hand: bf16 (2 bytes); feature batch 8 x 8192 tokens; generation batch 8, 8192 + 4096
    # positions; 42 layers, hidden 2560, head_dim 2560 / 32 = 80, vocabulary 157184
    working = 8 * 8192 * (6 * 2560 + 2 * 9216) * 2
    scores = 8 * 32 * 8192 * 8192 * 2
    assert items["features: one layer's activations"] == working + scores
    cache = 2 * 42 * 4 * 80 * 8 * (8192 + 4096) * 2
    assert items["generation: KV cache + logits"] == cache + 8 * 157184 * 4


def test_an_empty_nested_section_means_its_defaults(tmp_path):
    path = tmp_path / "recipe.yaml"
    # every key under train.loss and target.generation commented out, as under a top-level
    # section (which already meant its defaults); an empty optional section stays none
    path.write_text("target:\n  generation:\n    # top_k: 5\n  shape:\n"
                    "train:\n  loss:\n    # decay: 2\n  steps: 7\n")
    cfg = load_recipe(path)
    assert cfg.train.steps == 7
    assert cfg.train.loss.decay == 4.0 and cfg.target.generation.top_k == 20
    assert cfg.target.shape is None
