"""A tiny random target and a matching DSpark draft for the export and evaluator tests."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from draftforge.splitserve.config import TargetShape
from draftforge.splitserve.hf_backend import HFTarget
from draftforge.splitserve.random_target import random_llama
from draftforge.train.model import DSparkConfig, DSparkDraft

# The shape of recipes/tiny-debug.yaml's random target.
SHAPE = TargetShape(
    num_hidden_layers=4,
    hidden_size=64,
    vocab_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
)
LAYER_IDS = [0, 1, 2]


def tiny_target(seed: int = 0, sharpness: float = 1.0) -> HFTarget:
    """The random Llama target; its lm_head is redrawn with std ``sharpness`` so that greedy
    choices are not near-ties (a default-initialised random model has almost flat logits)."""
    model = random_llama(SHAPE, seed=seed)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        model.lm_head.weight.normal_(0.0, sharpness)
    return HFTarget(model, None, LAYER_IDS, name="random")


def draft_config(**overrides) -> DSparkConfig:
    fields = dict(
        vocab_size=SHAPE.vocab_size,
        hidden_size=SHAPE.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        target_hidden_size=SHAPE.hidden_size,
        num_target_layers=SHAPE.num_hidden_layers,
        target_layer_ids=LAYER_IDS,
        block_size=4,
        mask_token_id=3,
        markov_rank=16,
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        max_position_embeddings=SHAPE.max_position_embeddings,
    )
    fields.update(overrides)
    return DSparkConfig(**fields)


def tiny_eval_draft(target: HFTarget, seed: int = 0, **overrides) -> DSparkDraft:
    """A random draft with the target's embedding and lm_head and non-trivial Markov weights."""
    torch.manual_seed(seed)
    draft = DSparkDraft(draft_config(**overrides))
    draft.load_target_embeddings(target.embed_tokens_weight(), target.lm_head_weight())
    with torch.no_grad():
        if draft.markov_head is not None:
            draft.markov_head.markov_w2.weight.normal_(0, 0.3)
    return draft.eval()


def smollm2_draft(target: HFTarget, layer_ids: list[int], seed: int = 0) -> DSparkDraft:
    """A random one-layer draft of SmolLM2-135M's shape (block 4, Markov rank 16) reading
    ``layer_ids`` of the real target, with its embedding and lm_head."""
    cfg = DSparkConfig(
        vocab_size=49152, hidden_size=576, num_hidden_layers=1, num_attention_heads=9,
        num_key_value_heads=3, intermediate_size=1536, target_hidden_size=576,
        num_target_layers=30, target_layer_ids=layer_ids, block_size=4, mask_token_id=16,
        markov_rank=16, enable_confidence_head=True, confidence_head_with_markov=True,
        rope_theta=100000.0, max_position_embeddings=8192,
    )  # fmt: skip
    torch.manual_seed(seed)
    draft = DSparkDraft(cfg)
    draft.load_target_embeddings(target.embed_tokens_weight(), target.lm_head_weight())
    return draft.eval()


def random_prompts(count: int, length: int = 10, seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, SHAPE.vocab_size, (length,), generator=gen).tolist() for _ in range(count)]


TINY_DEBUG = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"


def tiny_debug_recipe(folder: Path, vocab_size: int = 512) -> Path:
    """``recipes/tiny-debug.yaml`` with these helpers' vocabulary, written into ``folder``."""
    path = folder / f"tiny-debug-{vocab_size}.yaml"
    path.write_text(re.sub(r"vocab_size: 49152.*", f"vocab_size: {vocab_size}", TINY_DEBUG.read_text()))
    return path
