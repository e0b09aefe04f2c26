"""DeepSpeed on a trainer subgroup (gloo on CPU): the world holds a rank that never trains,
like a target rank under a split."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from splitserve_helpers import free_port
from test_trainer_distributed import ALL_ANCHORS, launch

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed==0.19.8)"),
]


def test_zero3_on_a_trainer_subgroup_trains_like_an_all_trainer_world(tmp_path):
    """World of 3, ranks 1 and 2 train with ZeRO-3, rank 0 stands in for a target rank and
    waits in the end-of-run world barrier. ZeRO-3 barriers its world while it builds its
    optimizer and broadcasts from its rank 0 every step; on the whole world the trainers used
    to wait on rank 0 (or meet its end-of-run barrier and crash). Now DeepSpeed's world is the
    trainer group: the run, with a checkpoint and its gathered state, equals ZeRO-3 on a world
    of the same 2 trainers, step for step, and a resume from its checkpoint is exact."""
    train = dict(strategy="deepspeed", zero_stage=3, dtype="float32", steps=3, num_anchors=ALL_ANCHORS,
                 checkpoint_interval=2)
    split = launch(tmp_path, "zero3-sub", world=3, trainer_ranks=[1, 2], train=train, timeout=240,
                   pg_timeout_s=60)
    alone = launch(tmp_path, "zero3-all", world=2, trainer_ranks=[0, 1], train=train, timeout=240)
    assert split["steps"] == [1, 2, 3] and split["sample_ids"] == alone["sample_ids"]
    torch.testing.assert_close(torch.tensor(split["losses"]), torch.tensor(alone["losses"]), rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.tensor(split["grad_norms"]), torch.tensor(alone["grad_norms"]),
                               rtol=0, atol=1e-6)
    assert sorted(split["state"]) == sorted(alone["state"])
    for name, value in alone["state"].items():
        torch.testing.assert_close(split["state"][name], value, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # Resume from step 2 on the subgroup (DeepSpeed's own files, read back under the same world).
    step2 = tmp_path / "zero3-sub" / "checkpoints" / "step_00000002"
    rest = launch(tmp_path, "zero3-sub-rest", world=3, trainer_ranks=[1, 2], train=dict(train, resume=str(step2)),
                  timeout=240, pg_timeout_s=60)
    assert rest["resumed_step"] == 2 and rest["sample_ids"] == split["sample_ids"][2:]
    assert rest["losses"] == split["losses"][2:]
    for name, value in split["state"].items():
        assert torch.equal(rest["state"][name], value), name


def _adapter_rank(rank: int, port: int, out: str) -> None:
    """Rank 0 runs collectives on a group of its own; ranks 1 and 2 talk through the adapter."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="3",
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=3, timeout=timedelta(seconds=30))
    trainers, own = dist.new_group([1, 2]), dist.new_group([0])
    if rank == 0:
        for _ in range(3):
            dist.all_reduce(torch.ones(1), group=own)
    else:
        import deepspeed.comm as ds
        from deepspeed.comm import comm
        from deepspeed.runtime.zero.utils import assert_ints_same_as_other_ranks

        from draftforge.train import deepspeed_subgroup
        from draftforge.train.distributed import _skip_jit_shm_comm

        _skip_jit_shm_comm()
        undo = deepspeed_subgroup.install(trainers)
        seen = {"rank": ds.get_rank(), "world": ds.get_world_size(), "world_group": ds.get_world_group() is trainers}
        value = torch.tensor([float(rank)])
        ds.broadcast(value, src=1)  # DeepSpeed's rank 1: global rank 2
        total = torch.tensor([float(rank)])
        ds.all_reduce(total)
        ds.barrier()
        assert_ints_same_as_other_ranks([7, 0])  # ZeRO-3's per-step check: broadcasts from rank 0
        pair = ds.new_group([0, 1])
        summed = torch.tensor([10.0 * rank])
        ds.all_reduce(summed, group=pair)
        seen.update(broadcast=value.item(), all_reduce=total.item(), pair=ds.get_all_ranks_from_group(pair),
                    pair_rank=ds.get_rank(group=pair), pair_sum=summed.item())
        undo()
        seen.update(restored=type(comm.cdb).__name__, world_after=ds.get_world_size())
        with open(f"{out}/rank{rank}.json", "w") as handle:
            json.dump(seen, handle)
    dist.barrier()
    dist.destroy_process_group()


def test_subgroup_adapter_makes_the_trainer_group_deepspeeds_world(tmp_path):
    """Through the adapter, DeepSpeed's ranks, world, default group, broadcast sources and
    new groups are the trainer group's (global ranks 1 and 2 are DeepSpeed's 0 and 1), while
    rank 0 runs collectives of its own; undoing it restores DeepSpeed's backend."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, str(rank), str(port), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(3)]
    try:
        logs = [proc.communicate(timeout=120)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert [proc.returncode for proc in procs] == [0, 0, 0], "\n".join(log[-2000:] for log in logs)
    for rank in (1, 2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {"rank": rank - 1, "world": 2, "world_group": True, "broadcast": 2.0, "all_reduce": 3.0,
                        "pair": [0, 1], "pair_rank": rank - 1, "pair_sum": 30.0,
                        "restored": "TorchBackend", "world_after": 3}, rank


if __name__ == "__main__":  # one rank of the adapter test
    _adapter_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    from trainer_helpers import leave_at_once

    leave_at_once()
