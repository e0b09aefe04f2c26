"""Round 34: the advice of the split checks at a rank's start (splitserve/roles.py)."""

from __future__ import annotations

import pytest
from splitserve_helpers import tiny_recipe

from draftforge.config import RecipeError, load_recipe
from draftforge.errors import InputError
from draftforge.splitserve.roles import run_rank, split_problems

TWO_NODES = ["split.target_ranks=[0,1]", "split.trainer_ranks=[2,3]", "split.num_nodes=2",
             "train.strategy=fsdp2"]


def test_a_two_node_split_started_with_the_wrong_world_names_the_per_node_count(tmp_path, monkeypatch):
    """A split of 4 ranks over 2 nodes runs 4 / 2 = 2 processes on each: torchrun's
    --nproc_per_node counts one node's. Started as 8 (--nproc_per_node=4 on each node), the
    check said to start it with --nproc_per_node=4, which starts the same 8 again; a rank
    started without torchrun's environment was told the same."""
    cfg = load_recipe(tiny_recipe(tmp_path), TWO_NODES)
    assert (cfg.split.world_size, cfg.split.num_nodes) == (4, 2)
    per_node = 4 // 2
    [problem] = [p for p in split_problems(cfg, world_size=8, cuda_devices=0)
                 if p.startswith("split.world_size:")]
    assert "8 processes were started" in problem
    assert f"torchrun --nnodes=2 --nproc_per_node={per_node}" in problem, problem
    assert "--nproc_per_node=4" not in problem
    assert "on each of its 2 nodes" in problem

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InputError) as caught:
        run_rank(cfg)
    message = str(caught.value)
    assert (f"'torchrun --nnodes=2 --nproc_per_node={per_node} -m draftforge.train RECIPE' on each of "
            "its 2 nodes") in message, message
    assert "--nproc_per_node=4" not in message


def test_one_node_keeps_its_torchrun_advice(tmp_path):
    cfg = load_recipe(tiny_recipe(tmp_path))
    [problem] = [p for p in split_problems(cfg, world_size=3, cuda_devices=0)
                 if p.startswith("split.world_size:")]
    assert problem.endswith("start 2 (torchrun --nproc_per_node=2) or change the split")


def _crowded(cfg, gpus: int) -> str:
    [problem] = [p for p in split_problems(cfg, cuda_devices=gpus) if "NCCL refuses two ranks" in p]
    return problem


def test_more_nccl_ranks_on_a_node_than_gpus_is_not_told_to_name_the_gpus(tmp_path):
    """2 ranks, 1 GPU, NCCL: every rank needs a GPU of its own, so no device list can help
    (each one is refused below), yet the message said to name the GPUs in
    split.target_devices / split.trainer_devices; on several nodes the recipe loader refuses
    those lists outright. What it says instead must be accepted when followed."""
    recipe = tiny_recipe(tmp_path)
    nccl = ["train.device=cuda", "split.comm_backend=nccl"]
    problem = _crowded(load_recipe(recipe, nccl), gpus=1)
    assert "2 ranks on this node" in problem and "1 GPU(s) are visible" in problem
    # independently: the only way of naming the one GPU for the two ranks is refused
    named = load_recipe(recipe, [*nccl, "split.target_devices=[0]", "split.trainer_devices=[0]"])
    assert split_problems(named, cuda_devices=1)
    assert "name the GPUs with" not in problem
    assert "split.comm_backend=gloo" in problem
    followed = load_recipe(recipe, ["train.device=cuda", "split.comm_backend=gloo"])
    assert split_problems(followed, cuda_devices=1) == []

    # two nodes of 2 ranks, 1 GPU each: device lists are refused by the loader itself
    two = load_recipe(recipe, [*nccl, *TWO_NODES])
    problem = _crowded(two, gpus=1)
    with pytest.raises(RecipeError, match="split.target_devices"):
        load_recipe(recipe, [*nccl, *TWO_NODES, "split.target_devices=[0,0]"])
    assert "split.target_devices" not in problem and "split.num_nodes" in problem
    spread = load_recipe(recipe, [*nccl, *TWO_NODES[:2], "split.num_nodes=4", "train.strategy=fsdp2"])
    assert not [p for p in split_problems(spread, cuda_devices=1) if "NCCL refuses" in p]
