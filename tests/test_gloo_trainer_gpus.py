"""Trainer ranks of ``train.device cuda`` whose samples go over gloo: each takes its own GPU,
by its place among its node's trainer ranks (they all trained on GPU 0 before, since nothing
set a current device over gloo). Runs on the CPU with torch's CUDA calls stood in for."""

from __future__ import annotations

import pytest
import torch
from splitserve_helpers import tiny_recipe

from draftforge.config import load_recipe
from draftforge.splitserve import launch, roles
from draftforge.splitserve.dry_run import dry_run

GLOO_CUDA = ["split.comm_backend=gloo", "train.device=cuda"]


def _cfg(tmp_path, trainers: int, extra=()):
    return load_recipe(tiny_recipe(tmp_path, trainers=trainers), [*GLOO_CUDA, *extra])


def test_each_trainer_of_a_node_takes_the_next_gpu(tmp_path):
    one_node = _cfg(tmp_path, trainers=3).split  # target 0, trainers 1, 2, 3
    assert [roles.gloo_trainer_gpu(one_node, r) for r in (1, 2, 3)] == [0, 1, 2]
    # two nodes of two ranks: target 0 and trainer 1 on node 0, trainers 2 and 3 on node 1
    two_nodes = load_recipe(tiny_recipe(tmp_path, trainers=3),
                            [*GLOO_CUDA, "split.num_nodes=2"]).split
    assert [roles.gloo_trainer_gpu(two_nodes, r) for r in (1, 2, 3)] == [0, 0, 1]


def test_a_gloo_trainer_sets_its_gpu_and_a_target_rank_does_not(tmp_path, monkeypatch):
    """The rank's transport device stays the CPU (gloo); the trainer's current GPU, which the
    Trainer trains on, is set to its own."""
    cfg = _cfg(tmp_path, trainers=2)
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert roles._device(cfg, 2, "gloo") == torch.device("cpu")
    assert roles._device(cfg, 1, "gloo") == torch.device("cpu")
    assert roles._device(cfg, 0, "gloo") == torch.device("cpu")  # the target rank
    assert chosen == [1, 0]
    cpu = load_recipe(tiny_recipe(tmp_path, trainers=2), ["split.comm_backend=gloo"])
    assert roles._device(cpu, 2, "gloo") == torch.device("cpu")
    assert chosen == [1, 0]  # train.device cpu: no GPU taken


def test_more_gloo_trainers_on_a_node_than_gpus_are_refused(tmp_path):
    cfg = _cfg(tmp_path, trainers=2)
    problems = roles.split_problems(cfg, world_size=3, cuda_devices=1)
    assert any("2 trainer ranks [1, 2] would each take their own GPU" in p
               and "1 GPU(s) are visible" in p for p in problems), problems
    assert not any("own GPU" in p for p in roles.split_problems(cfg, world_size=3, cuda_devices=2))
    # train.device cpu over gloo takes no GPU, however many trainers
    cpu = load_recipe(tiny_recipe(tmp_path, trainers=2), ["split.comm_backend=gloo"])
    assert not any("own GPU" in p for p in roles.split_problems(cpu, world_size=3, cuda_devices=1))


@pytest.mark.parametrize("trainers", [1, 2])
def test_a_dry_run_plans_and_prints_one_gpu_per_gloo_trainer(tmp_path, trainers):
    cfg = _cfg(tmp_path, trainers=trainers)
    assert launch.planned_gpus(cfg) == trainers
    assert f"GPUs {list(range(trainers))} (gloo: in the order of the ranks)" in dry_run(cfg)
