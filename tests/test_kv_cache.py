"""``splitserve.kv_cache``: the preallocated cache gives transformers' own logits bit for bit,
through row dropping, buffer doubling and cropping; models with other layer kinds keep theirs."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen3Config
from transformers.cache_utils import DynamicCache

from draftforge.splitserve import sampling
from draftforge.splitserve.config import GenerationConfig
from draftforge.splitserve.kv_cache import GrowingCache, growing_cache


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


def run_steps(model, cache, input_ids, mask, steps: int, drop_after: int | None = None):
    """Prefill, then ``steps`` greedy steps; after step ``drop_after`` keep rows 0 and 2."""
    arg = sampling.kv_cache_argument(model)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                **{arg: cache})
    logits = [out.logits[:, -1]]
    token, position = out.logits[:, -1].argmax(-1), positions[:, -1:] + 1
    for step in range(steps):
        if step == drop_after:
            keep = torch.tensor([0, 2])
            cache.batch_select_indices(keep)
            token, mask, position = token[keep], mask[keep], position[keep]
        mask = torch.cat([mask, torch.ones(len(token), 1, dtype=mask.dtype)], dim=1)
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=position,
                    use_cache=True, **{arg: cache})
        logits.append(out.logits[:, -1])
        token, position = out.logits[:, -1].argmax(-1), position + 1
    return logits


@pytest.mark.parametrize("capacity", [64, 7])  # 7: the buffer fills and doubles twice
@torch.no_grad()
def test_logits_are_bit_identical_to_dynamic_cache(capacity):
    model = tiny_llama()
    input_ids = torch.randint(0, 64, (3, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    expected = run_steps(model, DynamicCache(), input_ids, mask, steps=12, drop_after=6)
    cache = GrowingCache(model.config.num_hidden_layers, capacity)
    got = run_steps(model, cache, input_ids, mask, steps=12, drop_after=6)
    assert len(got) == len(expected) == 13
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max()}"
    assert cache.get_seq_length() == 5 + 12
    assert cache.layers[0].keys.shape == (2, 2, 17, 8)


@torch.no_grad()
def test_crop_forgets_the_last_positions_and_the_next_update_overwrites_them():
    model = tiny_llama()
    ids = torch.randint(0, 64, (1, 9))
    cache = GrowingCache(3, 16)
    model(input_ids=ids, use_cache=True, **{sampling.kv_cache_argument(model): cache})
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    cache.crop(-3)
    assert cache.get_seq_length() == 6
    for layer, (keys, values) in zip(cache.layers, before, strict=True):
        assert torch.equal(layer.keys, keys[:, :, :6]) and torch.equal(layer.values, values[:, :, :6])
    new_keys = torch.ones(1, 2, 2, 8)
    keys, _ = cache.layers[0].update(new_keys, new_keys)
    assert keys.shape[2] == 8 and torch.equal(keys[:, :, 6:], new_keys)
    assert torch.equal(keys[:, :, :6], before[0][0][:, :, :6])
    with pytest.raises(ValueError, match="negative"):
        cache.crop(2)


@torch.no_grad()
def test_sampled_decoding_is_unchanged(monkeypatch):
    """``decode`` with the preallocated cache draws exactly what it drew with DynamicCache."""
    model = tiny_llama(seed=1)
    input_ids = torch.randint(2, 64, (4, 6))
    mask = torch.ones_like(input_ids)
    mask[1, :2] = 0
    settings = GenerationConfig(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=40)

    def run():
        return sampling.decode(model, input_ids, mask, settings, eos_ids=[0, 1], pad_id=0,
                               generator=torch.Generator().manual_seed(3))

    made, real = [], sampling.growing_cache

    def spy(model, capacity):
        made.append(real(model, capacity))
        return made[-1]

    monkeypatch.setattr(sampling, "growing_cache", spy)
    with_growing = run()
    # decode ran on the preallocated cache (else both runs below compare DynamicCache with itself)
    assert len(made) == 1 and isinstance(made[0], GrowingCache) and made[0].get_seq_length() > 6
    monkeypatch.setattr(sampling, "growing_cache", lambda model, capacity: None)
    assert torch.equal(with_growing, run())
    ended = (with_growing == 0) | (with_growing == 1)
    assert ended.any(dim=1).sum() >= 1, "no row ended: the row-dropping path went untested"


def test_models_with_sliding_layers_keep_their_own_cache():
    mistral = LlamaForCausalLM.__new__(LlamaForCausalLM)
    torch.nn.Module.__init__(mistral)
    mistral.config = MistralConfig(sliding_window=16, num_hidden_layers=2)
    assert growing_cache(mistral, 8) is None
    qwen = LlamaForCausalLM.__new__(LlamaForCausalLM)
    torch.nn.Module.__init__(qwen)
    qwen.config = Qwen3Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=16,
                              max_window_layers=1)
    assert growing_cache(qwen, 8) is None
    qwen.config = Qwen3Config(num_hidden_layers=2)
    assert isinstance(growing_cache(qwen, 8), GrowingCache)
