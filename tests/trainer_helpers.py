"""Tiny deterministic training problems for the trainer tests (shared with trainer_worker.py).

Sequences follow a fixed random permutation of the vocabulary; the target's
auxiliary features are a fixed random code of each token and its final state
points at the successor, so a draft can learn the chain and its loss falls.
"""

from __future__ import annotations

import torch

from draftforge.train.config import TrainConfig
from draftforge.train.model import DSparkConfig
from draftforge.train.sample import Sample

VOCAB, HIDDEN = 64, 32


def tiny_model_config(**overrides) -> DSparkConfig:
    fields = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, target_hidden_size=HIDDEN, num_target_layers=6,
        target_layer_ids=[0, 2, 4], block_size=4, mask_token_id=5, markov_rank=8,
        enable_confidence_head=True, confidence_head_with_markov=True, max_position_embeddings=256,
    )
    fields.update(overrides)
    return DSparkConfig(**fields)


def target_embeddings(seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    lm_head = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.3
    return embed, lm_head


def chain_samples(num: int, *, seed: int = 0, min_len: int = 16, max_len: int = 40,
                  nan_ids: tuple[int, ...] = ()) -> list[Sample]:
    """``num`` samples of a permutation chain with a 4-token unsupervised prompt."""
    cfg = tiny_model_config()
    _, lm_head = target_embeddings()
    gen = torch.Generator().manual_seed(1234)
    successor = torch.randperm(VOCAB, generator=gen)
    code = torch.randn(VOCAB, cfg.num_context_features, generator=gen)
    direction = 4.0 * lm_head / lm_head.norm(dim=-1).mean()
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(num):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        token = int(torch.randint(0, VOCAB, (1,), generator=gen))
        ids = [token]
        for _ in range(length - 1):
            ids.append(int(successor[ids[-1]]))
        input_ids = torch.tensor(ids)
        loss_mask = torch.zeros(length, dtype=torch.bool)
        loss_mask[4:] = True
        aux = code[input_ids].to(torch.bfloat16)
        final = direction[successor[input_ids]].to(torch.bfloat16)
        if index in nan_ids:
            aux = aux.clone()
            aux[5] = float("nan")
        samples.append(Sample(f"s{index:04d}", input_ids, loss_mask, aux, final, {"target": "chain"}))
    return samples


def train_config(tmp_output: str = "runs/test", **overrides) -> TrainConfig:
    fields = dict(
        strategy="single", dtype="float32", num_anchors=6, steps=12, lr=3e-3, warmup_ratio=0.1,
        log_interval=4, checkpoint_interval=100, keep_last=2, resume="never", output_dir=tmp_output,
        num_threads=1, seed=3,
    )
    fields.update(overrides)
    return TrainConfig(**fields)


def gather_strings_worker(rank: int, world: int, init: str, out: str) -> None:
    """A rank of test_train_r45's gather test (here, not in the test module: spawned processes
    unpickle it by module name, and pytest's importlib mode names test modules unimportably)."""
    import json

    import torch.distributed as dist

    from draftforge.train import distributed as D

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        mine = [f"r{rank}-é-{k}" for k in range(3 * rank)] + (["日本", ""] if rank else [])
        gathered = D.all_gather_strings(mine, group=dist.group.WORLD, device=torch.device("cpu"))
        told = D.broadcast_string("from one: ∑" if rank == 1 else None, group=dist.group.WORLD,
                                  device=torch.device("cpu"), src_group_rank=1)
        with open(f"{out}.{rank}", "w", encoding="utf-8") as f:
            json.dump({"gathered": gathered, "told": told}, f)
    finally:
        dist.destroy_process_group()
