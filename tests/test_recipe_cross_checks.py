"""Recipe checks across sections that used to pass a recipe which then failed (or ran wrong)
later: the target's config.json, the draft's positions and attention backend, the data's
loss-token floor, and the target's dtype on a CPU rank."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from draftforge.config import RecipeError, load_recipe
from draftforge.splitserve.registry import rope_theta_problem

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
TINY = RECIPES / "tiny-debug.yaml"

# a draft for a 4-layer, 64-wide target with SmolLM2's vocabulary
DRAFT = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "target_layer_ids": [0, 1], "block_size": 4, "mask_token_id": 16,
         "markov_rank": 8}  # fmt: skip
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 49152,
         "max_position_embeddings": 2048, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}  # fmt: skip


def target_recipe(tmp_path: Path, config: dict, target: dict | None = None) -> Path:
    """A recipe whose target is a local folder holding ``config.json`` = ``config``."""
    folder = tmp_path / "target"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"target": {"model": str(folder), **(target or {})}, "draft": DRAFT,
                                      "data": {"max_length": 96}}))  # fmt: skip
    return recipe


def refusal(path, overrides=()) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    (problem,) = info.value.problems
    return problem


# --------------------------------------------------------------------------- target config.json


def test_a_llama_folder_gives_its_shape_and_rope_base(tmp_path):
    cfg = load_recipe(target_recipe(tmp_path, LLAMA))
    assert cfg.target.shape.num_key_value_heads == 2 and cfg.draft.rope_theta == 500000.0


@pytest.mark.parametrize(("config", "says"), [
    # GPT-2 names its layers and width n_layer / n_embd
    ({"model_type": "gpt2", "n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 49152},
     "no num_hidden_layers; no hidden_size"),
    ({**LLAMA, "num_key_value_heads": None}, "num_key_value_heads: Input should be a valid integer, got null"),
])  # fmt: skip
def test_a_config_json_without_the_shape_is_refused_at_load_naming_the_field(tmp_path, config, says):
    """It used to read as "no shape known": every check against the target was skipped and
    training later said the config.json "cannot be read"."""
    recipe = target_recipe(tmp_path, config)
    line = recipe.read_text().splitlines().index(f"  model: {tmp_path / 'target'}") + 1
    assert refusal(recipe) == (
        f"{recipe}:{line}: target.model: cannot use the target's config.json: "
        f"{tmp_path / 'target' / 'config.json'}: {says}; declare the target's shape under target.shape"
    )
    # the way out the message names
    shape = {"num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 49152, "num_attention_heads": 4,
             "num_key_value_heads": 4, "rope_theta": 10000.0, "max_position_embeddings": 2048}  # fmt: skip
    cfg = load_recipe(target_recipe(tmp_path, config, {"shape": shape}))
    assert cfg.target.shape.num_key_value_heads == 4 and cfg.draft.rope_theta == 10000.0


def gemma3_config(rope_parameters: dict) -> dict:
    """A Gemma 3 text config as transformers 5 writes it: one RoPE base per layer type."""
    return {**LLAMA, "model_type": "gemma3_text", "head_dim": 16,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            "rope_parameters": rope_parameters}  # fmt: skip


def test_per_layer_type_rope_bases_give_the_full_attention_one(tmp_path):
    both = {"full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}  # fmt: skip
    cfg = load_recipe(target_recipe(tmp_path, gemma3_config(both)))
    assert cfg.draft.rope_theta == 1000000.0 and cfg.target.shape.rope_theta == 1000000.0
    assert rope_theta_problem(cfg) is None


def test_no_usable_rope_base_is_unknown_not_the_sections_default(tmp_path):
    """Per-layer-type bases without a full_attention entry, or none at all: the recipe records
    no rope_theta, and a launch names the file and the way out instead of training with 10000."""
    for config in (gemma3_config({"sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}),
                   {k: v for k, v in LLAMA.items() if k != "rope_parameters"}):  # fmt: skip
        recipe = target_recipe(tmp_path, config)
        cfg = load_recipe(recipe)
        assert cfg.draft.rope_theta is None
        assert "rope_theta" not in cfg.target.shape.model_fields_set
        assert rope_theta_problem(cfg) == (
            f"draft.rope_theta: {tmp_path / 'target' / 'config.json'} gives no RoPE base draftforge "
            "can use (no rope_theta, nor a full_attention entry in per-layer-type rope_parameters); "
            "set draft.rope_theta to the target's RoPE base in the recipe"
        )
        assert load_recipe(recipe, ["draft.rope_theta=250000.0"]).draft.rope_theta == 250000.0
        # its resolved recipe, reloaded where the folder is gone, knows no more
        saved = tmp_path / "config.yaml"
        saved.write_text(cfg.to_yaml())
        (tmp_path / "target" / "config.json").unlink()
        assert load_recipe(saved).draft.rope_theta is None
        assert load_recipe(saved, ["draft.rope_theta=250000.0"]).draft.rope_theta == 250000.0


# --------------------------------------------------------------------------- draft and data


def test_a_draft_max_position_below_the_sample_length_is_refused():
    cfg = load_recipe(TINY, ["draft.max_position_embeddings=128"])  # data.max_length 128: fits
    assert cfg.draft.max_position_embeddings == 128 == cfg.data.max_length
    assert refusal(TINY, ["draft.max_position_embeddings=127"]) == (
        "command line 'draft.max_position_embeddings=127': draft.max_position_embeddings: 127 is "
        "below data.max_length 128: training would place anchors at positions the draft does not "
        "support (and eval refuses them); raise it, leave it unset for the target's, or lower "
        "data.max_length"
    )


def test_flex_attention_is_refused_where_it_cannot_train():
    """torch's flex attention has no CPU backward, and its CUDA kernel needs heads of 16 or more
    (torch/_inductor/kernel/flex/flex_attention.py); both used to fail at the first step."""
    assert load_recipe(TINY, ["draft.attention_backend=flex"]).draft.head_dim == 16  # fits on CUDA
    assert refusal(TINY, ["draft.attention_backend=flex", "train.device=cpu"]).endswith(
        "draft.attention_backend: flex cannot train with train.device: cpu (torch's flex attention "
        "has no backward on the CPU); use draft.attention_backend: sdpa, or train on a GPU"
    )
    assert refusal(TINY, ["draft.attention_backend=flex", "draft.head_dim=8"]) == (
        "command line 'draft.attention_backend=flex': draft.attention_backend: flex needs "
        "draft.head_dim >= 16 (the minimum of its compiled CUDA kernel), this draft's is 8; use "
        "draft.attention_backend: sdpa or a larger head_dim"
    )
    assert load_recipe(TINY, ["draft.head_dim=8", "train.device=cpu"]).draft.attention_backend == "sdpa"


def test_a_loss_token_floor_no_sample_can_reach_is_refused():
    assert load_recipe(TINY, ["data.min_loss_tokens=127"]).data.min_loss_tokens == 127
    assert refusal(TINY, ["data.min_loss_tokens=128"]) == (
        "command line 'data.min_loss_tokens=128': data.min_loss_tokens: 128 is not below "
        "data.max_length 128: a sample also holds its prompt, so none would have that many "
        "supervised tokens and every one would be dropped; lower data.min_loss_tokens"
    )


# --------------------------------------------------------------------------- target dtype


@pytest.mark.parametrize(("dtype", "device", "expected"), [
    ("auto", "cpu", "float32"),  # resolved for the GPU at load, but this rank is on the CPU
    ("auto", "cuda", "bfloat16"),
    ("bfloat16", "cpu", "bfloat16"),  # the recipe's explicit choice stays
])  # fmt: skip
def test_a_target_rank_resolves_an_auto_dtype_for_its_own_device(monkeypatch, dtype, device, expected):
    """On a CUDA machine without native CPU bf16, a gloo job (train.device: cpu) runs its target
    rank on the CPU: the dtype auto resolved to at load (bfloat16, for CUDA) would be emulated
    there at ~1/70 of float32's speed."""
    import torch

    import draftforge.precision as precision
    import draftforge.splitserve.target as target_module
    from draftforge.splitserve.roles import build_engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda cpuinfo=None: [])  # an AVX2-only CPU
    cfg = load_recipe(RECIPES / "smollm2-cpu.yaml", ["train.device=cpu", f"target.dtype={dtype}"])
    assert cfg.target.dtype == "bfloat16"  # what the recipe records: auto on a CUDA machine

    built = []

    class Built(Exception):
        pass

    def build_target(target, layer_ids, *, device, tensor_parallel):
        built.append((target.dtype, device.type))
        raise Built

    monkeypatch.setattr(target_module, "build_target", build_target)
    ctx = SimpleNamespace(cfg=cfg, device=torch.device(device, 0) if device == "cuda" else torch.device("cpu"),
                          log=lambda line: None)  # fmt: skip
    threads = torch.get_num_threads()
    try:
        with pytest.raises(Built):
            build_engine(ctx)
    finally:
        torch.set_num_threads(threads)
    assert built == [(expected, device)]
    assert cfg.target.dtype == "bfloat16"  # the recipe itself is left as loaded
