"""Review leftovers of the dry run's planning output: the --node-rank advice, FSDP2's gathered
units, the target's head_dim, an SGLang target on the CPU, and where a problem is located."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftforge.config import RecipeError, load_recipe
from draftforge.errors import InputError

ROOT = Path(__file__).resolve().parents[1]


def test_a_dry_run_gives_a_one_node_recipes_node_rank_the_starts_advice(monkeypatch):
    from draftforge.splitserve.launch import main as train_main

    monkeypatch.chdir(ROOT)
    advice = ("--node-rank 1: the recipe runs on one node (split.num_nodes 1); drop --node-rank "
              "or set split.num_nodes")
    for dry in (["--dry-run"], []):
        with pytest.raises(InputError) as err:  # the option's error (before session 56, the recipe's)
            train_main(["recipes/tiny-debug.yaml", "--node-rank", "1", *dry])
        assert str(err.value) == advice
    with pytest.raises(InputError) as err:  # several nodes: the start's words too
        train_main(["recipes/ling3-flash-2node.yaml", "--dry-run", "--node-rank", "5"])
    assert str(err.value) == (
        "--node-rank: split.num_nodes is 2; give this machine's node rank (0..1; node n runs the "
        "8 ranks from n*8), got 5")


def _items(estimate) -> dict[str, float]:
    return {name.split(" (")[0]: value for name, value in estimate.items}


@pytest.mark.parametrize("recipe, layer, root", [
    # Ling: hidden 2560, 32 heads x 128 (q, k, v, o 4 x 2560 x 4096), q/k norms 2 x 128, MLP
    # 3 x 2560 x 6144, two norms 2 x 2560; root: fc 5 x 2560 x 2560, hidden_norm and norm,
    # Markov W1 + W2 2 x 157184 x 256, confidence head 2560 + 256 weights and a bias
    ("ling3-flash-dspark.yaml",
     4 * 2560 * 4096 + 2 * 128 + 3 * 2560 * 6144 + 2 * 2560,
     5 * 2560 * 2560 + 2 * 2560 + 2 * 157_184 * 256 + 2560 + 256 + 1),
    # Qwen3-8B: hidden 4096, 32 heads / 8 KV heads of 128, MLP 12288, vocabulary 151936
    ("qwen3-8b-dspark.yaml",
     2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 128 + 3 * 4096 * 12288 + 2 * 4096,
     5 * 4096 * 4096 + 2 * 4096 + 2 * 151_936 * 256 + 4096 + 256 + 1),
])
def test_fsdp2_gathers_a_layer_at_a_time_and_holds_the_root(recipe, layer, root):
    """fully_shard per layer, then the root (train/distributed.py): two layers gathered at
    once (one computing, the next prefetched) and the root's own parameters, which FSDP2 does
    not reshard after forward; the old figure put trainable / layers (the Markov head and fc
    in every layer: Ling 111,785,165 a layer) and never the root."""
    from draftforge.splitserve.dry_run import draft_parameter_counts, trainer_estimate

    assert (layer, root) in ((89_134_336, 113_254_145), (192_946_432, 161_689_857))
    cfg = load_recipe(ROOT / "recipes" / recipe, [])
    with_emb, without = draft_parameter_counts(cfg)
    assert without == 5 * layer + root
    items = _items(trainer_estimate(cfg, with_emb, without))
    assert items["gathered layers"] == 2 * layer * 2  # bf16
    assert items["gathered root"] == root * 2
    assert items["frozen embed + lm_head"] == (with_emb - without) * 2  # bf16, whole (r49)
    assert "gathered embed + lm_head" not in items
    assert "gathered params" not in items


QWEN3_4B = {"num_hidden_layers": 36, "hidden_size": 2560, "vocab_size": 151936,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 9728, "max_position_embeddings": 40960, "rope_theta": 1000000.0}


def test_the_targets_head_dim_comes_from_its_config_json(tmp_path):
    """Qwen3-4B: 32 heads of 128 on a hidden size of 2560 (hidden / heads is 80)."""
    from draftforge.splitserve.dry_run import target_estimate, target_parameters

    folder = tmp_path / "Qwen3-4B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_4B))
    text = (ROOT / "recipes/qwen3-8b-dspark.yaml").read_text()
    start, end = text.index("  shape:"), text.index("  generation:")
    text = text[:start] + text[end:]
    text = text.replace("/models/Qwen3-8B", str(folder)).replace(
        "[1, 9, 17, 25, 33]", "[1, 9, 17, 25, 33]\n  hidden_size: 2560").replace(
        "  hidden_size: 4096\n", "")
    recipe = tmp_path / "qwen3-4b.yaml"
    recipe.write_text(text)
    cfg = load_recipe(recipe, ["target.backend=hf", "draft.intermediate_size=9728"])
    items = _items(target_estimate(cfg))
    per_layer = 2560 * 128 * (2 * 32 + 2 * 8) + 3 * 2560 * 9728 + 2 * 2560
    params = 2 * 151936 * 2560 + 36 * per_layer + 2560
    assert params == 4_411_415_040  # (with 80: 4,057,520,640)
    assert items["weights"] == params * 2
    # generation batch 8, 4096 + 4096 positions, bf16, and 8 rows of fp32 logits
    assert items["generation: KV cache + logits"] == (
        2 * 36 * 8 * 128 * 8 * (4096 + 4096) * 2 + 8 * 151936 * 4)
    from draftforge.splitserve.registry import resolve_target_shape
    shape = resolve_target_shape(cfg.target)
    assert shape.head_dim == 128  # read from config.json with the rest of the shape
    assert target_parameters(shape.model_copy(update={"head_dim": None})) == 4_057_520_640  # 80


def test_an_sglang_target_over_gloo_is_said_to_run_on_the_cpu():
    from draftforge.splitserve.dry_run import sglang_pool_note

    gloo = load_recipe(ROOT / "recipes/ling3-flash-dspark.yaml",
                       ["split.comm_backend=gloo", "split.target_devices=null",
                        "split.trainer_devices=null"])
    note = sglang_pool_note(gloo)
    assert "GPU" not in note.replace("sizes GPU memory", "")
    assert "on its GPU" not in note and "sglang_mem_fraction =" not in note
    assert note.startswith("  (target.backend sglang over gloo: the target ranks run on the CPU")
    assert "KV pools of 65536 tokens each" in note
    assert "target.sglang_mem_fraction sizes GPU memory and is unused on the CPU" in note
    nccl = sglang_pool_note(load_recipe(ROOT / "recipes/ling3-flash-dspark.yaml", []))
    assert "on each of a group's 4 GPUs" in nccl


def test_a_problem_of_an_unset_key_is_located_at_the_key_it_names_that_was_set(tmp_path):
    """split.feature_batch_size (not set) x data.max_length over the runner's pool: located at
    the data.max_length that was set (its line, or the override), not the split: section."""
    from draftforge.splitserve.roles import check_split

    recipe = ROOT / "recipes/qwen3-8b-dspark.yaml"
    lines = recipe.read_text().splitlines()
    cfg = load_recipe(recipe, ["data.max_length=16384", "split.token_budget=16384"])
    with pytest.raises(RecipeError) as err:
        check_split(cfg)
    assert err.value.problems[0].startswith(
        "command line 'data.max_length=16384': split.feature_batch_size: 8 rows")
    path = tmp_path / "long.yaml"
    path.write_text(recipe.read_text().replace("max_length: 4096", "max_length: 16384"))
    cfg = load_recipe(path, ["split.token_budget=16384"])
    with pytest.raises(RecipeError) as err:
        check_split(cfg)
    at = lines.index("  max_length: 4096") + 1
    assert err.value.problems[0].startswith(f"{path}:{at}: split.feature_batch_size: 8 rows")
    # a key that was set is still located at its own line
    cfg = load_recipe(path, ["split.token_budget=16384", "split.feature_batch_size=16"])
    with pytest.raises(RecipeError) as err:
        check_split(cfg)
    assert err.value.problems[0].startswith("command line 'split.feature_batch_size=16': ")
