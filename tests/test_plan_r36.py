"""Planning a job before renting GPUs: what ``draftforge train RECIPE --dry-run`` says about the
GPUs a split needs and about GPUs two ranks would share."""

from __future__ import annotations

from pathlib import Path

import pytest
from splitserve_helpers import tiny_recipe

from draftforge.config import RecipeError, load_recipe
from draftforge.splitserve import launch
from draftforge.splitserve.roles import split_problems

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def test_a_device_list_naming_one_gpu_twice_is_refused_at_that_list(tmp_path, capsys):
    """``split.target_devices=[0,0]`` shares GPU 0 because that list names it twice: the message
    leads with the list (so the file's line or the override is shown), says the list named it,
    and asks to list each GPU once, not that a group 'without a device list' took LOCAL_RANK."""
    recipe = tiny_recipe(tmp_path)
    cfg = load_recipe(recipe, ["train.device=cuda", "split.comm_backend=nccl", "split.target_ranks=[0,1]",
                               "split.trainer_ranks=[2]", "split.target_devices=[0,0]",
                               "split.trainer_devices=[1]"])
    shared = [p for p in split_problems(cfg, world_size=3, cuda_devices=2) if "share GPU" in p]
    assert len(shared) == 1
    assert shared[0].startswith("split.target_devices: ranks [0, 1] would share GPU 0")
    assert "split.target_devices names GPU 0 for ranks [0, 1]" in shared[0]
    assert "list each GPU once in split.target_devices" in shared[0]
    assert "without a device list" not in shared[0]
    with pytest.raises(RecipeError) as refused:
        launch.main([str(recipe), "train.device=cuda", "split.comm_backend=nccl", "split.target_ranks=[0,1]",
                     "split.trainer_ranks=[2]", "split.target_devices=[0,0]", "split.trainer_devices=[1]",
                     "--dry-run"])
    assert "command line 'split.target_devices=[0,0]': split.target_devices: ranks [0, 1]" in str(refused.value)


def test_a_gpu_in_both_lists_is_reported_once_at_trainer_devices(tmp_path):
    """A GPU named by both groups' lists: one problem, at split.trainer_devices, not also a
    'would share' line claiming a group had no device list."""
    recipe = tiny_recipe(tmp_path)
    cfg = load_recipe(recipe, ["train.device=cuda", "split.comm_backend=nccl",
                               "split.target_devices=[1]", "split.trainer_devices=[1]"])
    problems = split_problems(cfg, world_size=2, cuda_devices=2)
    assert [p for p in problems if "GPU" in p] == [
        "split.trainer_devices: GPUs [1] are in both target_devices and trainer_devices (two ranks "
        "on one GPU, which NCCL refuses); give each group its own GPUs"]


def test_a_listed_gpu_meeting_a_local_rank_one_says_which_is_which(tmp_path):
    recipe = tiny_recipe(tmp_path)
    cfg = load_recipe(recipe, ["train.device=cuda", "split.comm_backend=nccl", "split.target_devices=[1]"])
    shared = [p for p in split_problems(cfg, world_size=2, cuda_devices=2) if "share GPU" in p]
    assert shared == [
        "split: ranks [0, 1] would share GPU 1 (split.target_devices names GPU 1 for ranks [0]; rank 1 "
        "has no device list and takes GPU LOCAL_RANK 1); NCCL refuses two ranks on one GPU: name each "
        "rank's GPU in split.target_devices and split.trainer_devices"]


def test_the_one_node_plan_says_how_many_gpus_the_machine_needs(capsys):
    """A dry run plans for the machine the recipe names: it cannot refuse 16 ranks on one node,
    but it must say the node needs 16 GPUs, more than an 8-GPU node has, and what to do."""
    two_node = str(RECIPES / "ling3-flash-2node.yaml")
    assert launch.main([two_node, "split.num_nodes=1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("  GPUs:"))
    assert line.startswith("  GPUs: this machine needs 16 (GPUs 0-15); more than the 8 of most GPU nodes")
    assert "split.num_nodes" in line
    assert launch.main([str(RECIPES / "ling3-flash-dspark.yaml"), "--dry-run"]) == 0
    assert "  GPUs: this machine needs 8 (GPUs 0-7)\n" in capsys.readouterr().out
    # the CPU recipe: GPUs only where there are some
    assert launch.main([str(RECIPES / "tiny-debug.yaml"), "--dry-run"]) == 0
    assert ("  GPUs: this machine needs 2 (GPUs 0-1) where GPUs are visible (comm_backend auto); "
            "without GPUs every rank runs on the CPU") in capsys.readouterr().out
    assert launch.main([str(RECIPES / "tiny-debug.yaml"), "train.device=cpu", "--dry-run"]) == 0
    assert "GPUs:" not in capsys.readouterr().out
