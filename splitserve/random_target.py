"""``target.model: random``: a seeded, randomly initialised Llama of the recipe's declared shape.

For fast tests and dry runs of the plumbing only: a draft trained against it
learns nothing about acceptance. ``features`` works on token ids; ``generate``
needs a tokenizer, which exists when the declared vocabulary is at most
SmolLM2's: SmolLM2's tokenizer cut to the first ``vocab_size`` tokens is borrowed
(:mod:`~draftforge.splitserve.borrowed_tokenizer`; SmolLM2 is converted once if needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from draftforge.splitserve.hf_backend import DTYPES, HFTarget, set_cpu_threads

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from draftforge.splitserve.config import TargetConfig, TargetShape

def random_llama(shape: TargetShape, *, seed: int, dtype: torch.dtype = torch.float32):
    """A ``LlamaForCausalLM`` of ``shape`` with weights drawn from ``seed`` (global RNG untouched)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape.head_dim is None and shape.hidden_size % shape.num_attention_heads:
        raise ValueError(
            f"target.shape.hidden_size {shape.hidden_size} is not a multiple of "
            f"num_attention_heads {shape.num_attention_heads}"
        )
    if shape.num_attention_heads % shape.num_key_value_heads:
        raise ValueError(
            f"target.shape.num_attention_heads {shape.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {shape.num_key_value_heads}"
        )
    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,  # None: hidden_size / num_attention_heads
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=shape.tie_word_embeddings,
    )
    # the weights are drawn on the CPU: seed its generator alone (``torch.manual_seed`` would
    # also reseed every CUDA generator, which ``fork_rng(devices=[])`` does not restore)
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


class RandomTarget(HFTarget):
    """A random Llama target; its tokenizer is SmolLM2's, cut to its vocabulary."""

    def __init__(self, model, layer_ids: Sequence[int], *, cache_dir: str | None) -> None:
        super().__init__(model, None, layer_ids, name="random")
        self.trained = False
        self._cache_dir = cache_dir

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """SmolLM2's tokenizer cut to the vocabulary; an error for a size that has none."""
        if self._tokenizer is None:
            from draftforge.splitserve import borrowed_tokenizer as bt

            if not bt.has_tokenizer(self.vocab_size):
                raise RuntimeError(
                    f"target 'random' has vocab_size {self.vocab_size} and no tokenizer: random "
                    f"targets of that size support features() on token ids only. Declare "
                    f"{bt.MIN_VOCAB} <= target.shape.vocab_size <= {bt.FULL_VOCAB} to borrow "
                    f"SmolLM2's tokenizer (and chat template) cut to that size, or use a real "
                    f"target for generate()"
                )
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(
                str(bt.tokenizer_dir(self.vocab_size, self._cache_dir)))
        return self._tokenizer

    def eos_token_ids(self) -> list[int]:
        """The borrowed tokenizer's end-of-sequence token."""
        return [int(self.tokenizer.eos_token_id)]


def build_random_target(
    cfg: TargetConfig, layer_ids: Sequence[int], *, device: str | torch.device = "cpu"
) -> RandomTarget:
    """Build ``target.model: random`` from ``cfg.shape`` and ``cfg.seed``."""
    if cfg.shape is None:
        raise ValueError("target.model 'random' needs a declared target.shape section")
    set_cpu_threads(cfg.num_threads, device)
    model = random_llama(cfg.shape, seed=cfg.seed, dtype=DTYPES[cfg.dtype]).to(device)
    return RandomTarget(model, layer_ids, cache_dir=cfg.cache_dir)
