"""Tiny deterministic training problems for the trainer tests (shared with trainer_worker.py).

Sequences follow a fixed random permutation of the vocabulary; the target's
auxiliary features are a fixed random code of each token and its final state
points at the successor, so a draft can learn the chain and its loss falls.
"""

from __future__ import annotations

import os

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


def run_script_ranks(script: str, job: os.PathLike[str], *, world: int = 2, timeout: float = 240) -> list[str]:
    """Run ``python script job`` as ``world`` gloo ranks on loopback (one thread each); their
    outputs, after asserting that every rank exited 0."""
    import subprocess
    import sys

    from splitserve_helpers import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, script, str(job)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                       RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                                       OMP_NUM_THREADS="1"))
             for rank in range(world)]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0] * world, "\n".join(log[-3000:] for log in logs)
    return logs


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
    leave_at_once()


def full_state_worker(rank: int, world: int, init: str, out: str) -> None:
    """A rank of test_distributed_r49's gather test: an FSDP2-sharded module's full state,
    kept on rank 0 only, with the most gathered tensors alive at once on each rank."""
    import json
    import weakref

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from draftforge.train import distributed as D

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3), torch.nn.Linear(3, 7))
        model.register_buffer("scale", torch.tensor([2.0, 3.0]))
        unsharded = {k: v.detach().clone() for k, v in model.state_dict().items()}
        mesh = D.device_mesh(group=dist.group.WORLD, device_type="cpu")
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        alive: list = []
        most = 0
        original = DTensor.full_tensor

        def counting(self, *args, **kwargs):
            nonlocal most
            result = original(self, *args, **kwargs)
            alive[:] = [ref for ref in alive if ref() is not None] + [weakref.ref(result)]
            most = max(most, len(alive))
            return result

        DTensor.full_tensor = counting
        try:
            state = D.full_state_fsdp2(model, keep=rank == 0)
        finally:
            DTensor.full_tensor = original
        equal = [name for name in state if torch.equal(state[name], unsharded[name])]
        for value in state.values():  # the result is a copy: the module's state stays as it is
            value.add_(1.0)
        again = D.full_state_fsdp2(model, keep=True)
        result = {
            "keys": sorted(state),
            "equal": equal,
            "untouched": all(torch.equal(again[name], unsharded[name]) for name in unsharded),
            "most_alive": most,
        }
        with open(f"{out}.{rank}", "w", encoding="utf-8") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()
    leave_at_once()


def fsdp2_layout_worker(rank: int, world: int, init: str, out: str) -> None:
    """A rank of test_distributed_r49's layout test: a bf16 FSDP2 trainer's parameters (sharded
    or whole, and their dtype) after one step, and its gathered full state."""
    import json

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from draftforge.train.sample import pack
    from draftforge.train.trainer import Trainer

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        run_dir = f"{out}.run"
        trainer = Trainer(model_config=tiny_model_config(), embeddings=target_embeddings(), run_dir=run_dir,
                          train=train_config(run_dir, strategy="fsdp2", dtype="bfloat16", steps=1),
                          group=dist.group.WORLD)
        trainer.fit(pack(chain_samples(8)[rank::world], 80)[:1])
        layout = {name: [isinstance(p, DTensor), str(p.dtype).removeprefix("torch."), p.requires_grad]
                  for name, p in trainer.model.named_parameters()}
        embed, lm_head = target_embeddings()
        frozen_equal = (torch.equal(trainer.model.embed_tokens.weight, embed.to(torch.bfloat16))
                        and torch.equal(trainer.model.lm_head.weight, lm_head.to(torch.bfloat16)))
        full = trainer.full_state_dict()
        with open(f"{out}.{rank}", "w", encoding="utf-8") as f:
            json.dump({"layout": layout, "frozen_equal": frozen_equal,
                       "full_dtypes": {k: str(v.dtype).removeprefix("torch.") for k, v in full.items()}}, f)
    finally:
        dist.destroy_process_group()
    leave_at_once()


def deepspeed_full_state_worker(rank: int, world: int, init: str, out: str) -> None:
    """A rank of test_ckpt_r50's gather test: a ZeRO-2 trainer's full state kept on rank 0
    only, with the most gathered fp32 masters alive at once on each rank."""
    import json
    import weakref

    import deepspeed.utils
    import torch.distributed as dist

    from draftforge.train.trainer import Trainer

    os.environ["LOCAL_RANK"] = str(rank)  # DeepSpeed asserts a launcher set it
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        run_dir = f"{out}.run"
        trainer = Trainer(model_config=tiny_model_config(), embeddings=target_embeddings(), run_dir=run_dir,
                          train=train_config(run_dir, strategy="deepspeed", zero_stage=2, steps=1),
                          group=dist.group.WORLD)
        alive: list = []
        most = 0
        original = deepspeed.utils.safe_get_full_fp32_param

        def counting(param):
            nonlocal most
            result = original(param)
            alive[:] = [ref for ref in alive if ref() is not None] + [weakref.ref(result)]
            most = max(most, len(alive))
            return result

        deepspeed.utils.safe_get_full_fp32_param = counting
        try:
            kept = trainer.full_state_dict(every_rank=False)
        finally:
            deepspeed.utils.safe_get_full_fp32_param = original
        everywhere = trainer.full_state_dict()
        with open(f"{out}.{rank}", "w", encoding="utf-8") as f:
            json.dump({"kept": sorted(kept), "all": sorted(everywhere), "most_alive": most,
                       "trainable": sum(p.requires_grad for p in trainer.model.parameters()),
                       "same": all(torch.equal(kept[k], everywhere[k]) for k in kept)}, f)
    finally:
        dist.destroy_process_group()
    leave_at_once()


def full_state_one_rank_worker(rank: int, world: int, init: str, out: str) -> None:
    """A one-rank FSDP2 mesh, whose full tensors are its local shards: the full state must be
    a copy, unchanged by a later update of the live weights."""
    import json

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from draftforge.train import distributed as D

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        fully_shard(model, mesh=D.device_mesh(group=dist.group.WORLD, device_type="cpu"))
        state = D.full_state_fsdp2(model, keep=True)
        with torch.no_grad():
            for param in model.parameters():
                param.to_local().add_(1.0)  # what an optimizer step does to the masters
        with open(f"{out}.{rank}", "w", encoding="utf-8") as f:
            json.dump({"unchanged": all(torch.equal(state[k], before[k]) for k in before)}, f)
    finally:
        dist.destroy_process_group()
    leave_at_once()


def deepspeed_bf16_masters_worker(rank: int, world: int, init: str, out: str) -> None:
    """A rank of test_ckpt_r51's ZeRO-3 bf16 test: the fp32 masters a ``deepspeed`` trainer
    starts from, against a ``single`` trainer's initial weights."""
    import json

    import torch.distributed as dist

    from draftforge.train.trainer import Trainer

    os.environ["LOCAL_RANK"] = str(rank)  # DeepSpeed asserts a launcher set it
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        def trainable_state(strategy: str, **settings) -> dict:
            run_dir = f"{out}.{strategy}.{rank}"
            trainer = Trainer(model_config=tiny_model_config(num_hidden_layers=1), embeddings=target_embeddings(),
                              run_dir=run_dir, group=dist.group.WORLD if strategy != "single" else None,
                              train=train_config(run_dir, strategy=strategy, dtype="bfloat16", **settings))
            names = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
            return {k: v for k, v in trainer.full_state_dict().items() if k in names}

        reference = trainable_state("single")
        masters = trainable_state("deepspeed", zero_stage=3)
        with open(f"{out}.{rank}", "w", encoding="utf-8") as f:
            json.dump({"names": sorted(masters) == sorted(reference),
                       "exact": sum(torch.equal(masters[k], reference[k]) for k in reference),
                       "total": len(reference),
                       "odd": sum(v.numel() % world != 0 for v in reference.values())}, f)
    finally:
        dist.destroy_process_group()
    leave_at_once()


def leave_at_once() -> None:
    """End a finished rank the way ``python -m draftforge.train`` does, without C++ static
    destructors: over gloo they abort now and then ("terminate called without an active
    exception", SIGABRT) after every result is written and the group is destroyed, failing a
    rank that succeeded. Seen with DeepSpeed and with FSDP2 ranks, in full suites on a loaded
    machine; a barrier before ``destroy_process_group`` did not prevent it."""
    from draftforge.train.__main__ import exit_now

    exit_now(0)
