"""Review round 22 of the target backend (splitserve/target.py, hf_backend, sampling, kv_cache,
random_target, smollm2): findings checked against transformers or hand-derived values."""

from __future__ import annotations

import torch

from draftforge.splitserve.config import TargetShape
from draftforge.splitserve.random_target import random_llama

SHAPE = TargetShape(
    num_hidden_layers=2,
    hidden_size=32,
    vocab_size=40,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
)


def test_a_random_target_leaves_the_cuda_generators_alone_and_keeps_its_weights(monkeypatch):
    """``random_llama`` promises the global RNG untouched. ``torch.manual_seed`` also reseeds
    every CUDA generator (at once, or lazily when CUDA starts), which ``fork_rng(devices=[])``
    does not restore: a process that built a random target on a GPU machine had its CUDA RNG
    set to the target's seed. The weights stay those of the CPU generator seeded so."""
    from transformers import LlamaForCausalLM

    reference = random_llama(SHAPE, seed=4)
    seeded: list[int] = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: seeded.append(seed))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: seeded.append(seed))
    cpu_state = torch.random.get_rng_state()
    model = random_llama(SHAPE, seed=4)
    assert seeded == []  # no CUDA generator reseeded
    assert torch.equal(torch.random.get_rng_state(), cpu_state)  # nor the CPU one left changed
    # the same weights as the CPU generator seeded with 4 draws (what the old code drew)
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(4)
        expected = LlamaForCausalLM(model.config)
    for (name, got), (_, want), (_, before) in zip(model.state_dict().items(),
                                                   expected.state_dict().items(),
                                                   reference.state_dict().items(), strict=True):
        assert torch.equal(got, want), name
        assert torch.equal(got, before), name
