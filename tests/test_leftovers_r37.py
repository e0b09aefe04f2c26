"""Round 37 leftovers: train.zero_stage set where no strategy reads it; target.shape.head_dim."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from splitserve_helpers import read_logs, spawn_ranks, tiny_recipe, wait_all

from draftforge.config import RecipeError, load_recipe
from draftforge.splitserve.dry_run import dry_run
from draftforge.train.config import ignored_zero_stage_note

ROOT = Path(__file__).resolve().parents[1]
NOTE = "train.zero_stage 3 is ignored: it is the ZeRO stage of train.strategy deepspeed"


@pytest.mark.parametrize(("strategy", "stage", "said"), [
    ("fsdp2", 3, "this run's strategy is fsdp2 (FSDP2 shards parameters, gradients and optimizer "
                 "state anyway, as ZeRO-3 does)"),
    ("single", 3, "this run's strategy is single (one trainer rank shards nothing)"),
    ("fsdp2", 2, None),  # the default stage says nothing
    ("deepspeed", 3, None),  # read
])
def test_a_zero_stage_no_strategy_reads_is_noted_in_the_dry_run(tmp_path, strategy, stage, said):
    """train.zero_stage=3 beside fsdp2 trained exactly as without it, without a word: a user
    asking for ZeRO-3 memory savings under FSDP2 was not told the key does nothing there."""
    trainers = 1 if strategy == "single" else 2
    cfg = load_recipe(tiny_recipe(tmp_path, trainers=trainers),
                      [f"train.strategy={strategy}", f"train.zero_stage={stage}"])
    note = ignored_zero_stage_note(cfg.train)
    text = dry_run(cfg)
    if said is None:
        assert note is None and "ZeRO stage of train.strategy" not in text  # (the config lists the key)
        return
    assert note == f"{NOTE}, and {said}"
    assert f"note: {note}" in text.splitlines()


@pytest.mark.distributed
def test_a_run_with_an_ignored_zero_stage_says_so_once(tmp_path):
    recipe = tiny_recipe(tmp_path, steps=2, overrides={"train.zero_stage": 3, "train.checkpoint_interval": 100})
    procs = spawn_ranks(recipe, 2, log_dir=tmp_path / "logs")
    assert wait_all(procs, 120) == [0, 0], read_logs(tmp_path / "logs", 2)
    target, trainer = read_logs(tmp_path / "logs", 2)
    assert NOTE not in target
    [line] = [line for line in trainer.splitlines() if NOTE in line]
    assert line.startswith("[rank 1 trainer] note: ")


# -- target.shape.head_dim: declared, read from config.json, used by model: random -------------

QWEN3_4B_SHAPE = {"num_hidden_layers": 36, "hidden_size": 2560, "vocab_size": 151936,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                  "intermediate_size": 9728, "max_position_embeddings": 40960,
                  "rope_theta": 1000000.0}


def _estimate(cfg) -> dict[str, float]:
    from draftforge.splitserve.dry_run import target_estimate

    return {name.split(" (")[0]: value for name, value in target_estimate(cfg).items}


def test_a_declared_head_dim_sizes_the_dry_runs_weights_and_kv_cache(tmp_path):
    """A multi-node plan without the target's folder declares its shape; Qwen3-4B's heads are
    128 wide where hidden / heads is 80. target.shape had no head_dim to declare, so the
    estimate took 80 (weights 4,057,520,640 parameters instead of 4,411,415,040)."""
    from draftforge.splitserve.registry import target_head_dim

    recipe = yaml.safe_load((ROOT / "recipes/qwen3-8b-dspark.yaml").read_text())
    recipe["target"].update(model="/nowhere/Qwen3-4B", backend="hf", shape=dict(QWEN3_4B_SHAPE))
    recipe["draft"].update(hidden_size=2560, intermediate_size=9728)
    path = tmp_path / "qwen3-4b.yaml"
    path.write_text(yaml.safe_dump(recipe))
    cfg = load_recipe(path)
    assert target_head_dim(cfg.target.shape) == 128
    items = _estimate(cfg)
    per_layer = 2560 * 128 * (2 * 32 + 2 * 8) + 3 * 2560 * 9728 + 2 * 2560
    assert items["weights"] == (2 * 151936 * 2560 + 36 * per_layer + 2560) * 2  # bf16
    gen = cfg.target.generation
    seq = cfg.data.max_length + gen.max_new_tokens
    assert items["generation: KV cache + logits"] == (
        2 * 36 * 8 * 128 * gen.batch_size * seq * 2 + gen.batch_size * 151936 * 4)


def test_a_declared_head_dim_is_checked_against_the_folders_config(tmp_path):
    recipe = tiny_recipe(tmp_path)
    shape = yaml.safe_load(recipe.read_text())["target"]["shape"]
    folder = tmp_path / "target"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(  # hidden / heads: 16
        {**shape, "head_dim": 32, "max_position_embeddings": 2048, "rope_theta": 10000.0}))
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe, [f"target.model={folder}", "target.shape.head_dim=64"])
    assert (f"command line 'target.shape.head_dim=64': target.shape.head_dim: 64 differs from "
            f"{folder}'s head_dim 32; remove it or fix it") in err.value.problems, err.value.problems
    cfg = load_recipe(recipe, [f"target.model={folder}"])  # the declared shape, head_dim read
    assert cfg.target.shape.head_dim == 32


def test_a_declared_head_dim_is_checked_where_the_folders_config_gives_none(tmp_path):
    """Llama's and Qwen2's config.json have no head_dim (or null): the model's is hidden /
    heads, and a declared one that differs is refused as a differing declared field is."""
    recipe = tiny_recipe(tmp_path)
    shape = yaml.safe_load(recipe.read_text())["target"]["shape"]
    shape.pop("head_dim", None)
    derived = shape["hidden_size"] // shape["num_attention_heads"]
    for name, extra in (("absent", {}), ("null", {"head_dim": None})):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(
            {**shape, **extra, "max_position_embeddings": 2048, "rope_theta": 10000.0}))
        with pytest.raises(RecipeError) as err:
            load_recipe(recipe, [f"target.model={folder}", f"target.shape.head_dim={2 * derived}"])
        assert (f"command line 'target.shape.head_dim={2 * derived}': target.shape.head_dim: "
                f"{2 * derived} differs from {folder}'s head_dim {derived} (its config.json gives "
                f"none, so hidden_size {shape['hidden_size']} / num_attention_heads "
                f"{shape['num_attention_heads']}); remove it or fix it") in err.value.problems, err.value.problems
        cfg = load_recipe(recipe, [f"target.model={folder}", f"target.shape.head_dim={derived}"])
        assert cfg.target.shape.head_dim == derived


def test_a_random_target_takes_a_declared_head_dim(tmp_path):
    """model: random with heads wider than hidden / heads (as Qwen3's): the recipe loader
    refused a hidden size not divisible by the heads, and the head width was ignored."""
    from draftforge.splitserve.random_target import random_llama

    cfg = load_recipe(tiny_recipe(tmp_path), ["target.shape.hidden_size=72",
                                               "target.shape.head_dim=32",
                                               "draft.hidden_size=72", "draft.head_dim=16"])
    assert cfg.target.shape.head_dim == 32
    model = random_llama(cfg.target.shape, seed=0)
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.weight.shape == (4 * 32, 72)
    assert attention.k_proj.weight.shape == (2 * 32, 72)
    assert attention.o_proj.weight.shape == (72, 4 * 32)


# -- target.shape.tie_word_embeddings: a tied target's matrix counted once ------------------


def test_a_tied_targets_dense_estimate_counts_its_embedding_once(tmp_path):
    """SmolLM2-135M ties its lm_head to its embedding: the dense estimate counted the
    49,152 x 576 matrix twice (162,826,560 against the real 134,515,008, which the registry
    declares from the weights). A folder's config.json says whether it ties."""
    from transformers import LlamaConfig

    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.dry_run import target_parameters
    from draftforge.splitserve.registry import KNOWN_TARGETS, resolve_target_shape

    known = KNOWN_TARGETS["smollm2-135m-instruct"]
    config = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                         tie_word_embeddings=True)
    config.save_pretrained(tmp_path / "tied")
    shape = resolve_target_shape(TargetConfig(model=str(tmp_path / "tied")))
    assert shape.tie_word_embeddings is True and shape.num_parameters is None
    assert target_parameters(shape) == known.num_parameters == 134_515_008
    untied = shape.model_copy(update={"tie_word_embeddings": False})
    assert target_parameters(untied) == 134_515_008 + 49152 * 576


def test_a_random_target_takes_a_declared_tie(tmp_path):
    from draftforge.splitserve.random_target import random_llama

    cfg = load_recipe(tiny_recipe(tmp_path), ["target.shape.tie_word_embeddings=true"])
    model = random_llama(cfg.target.shape, seed=0)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
