"""Review round 10 of the multi-node plan, the eval placement and the SGLang feature runner.

The launch plans are compared with plans worked out by hand for two 8-GPU nodes; the runner's
cleanup with a child that outlives SIGTERM; the loopback port on a host whose ephemeral range
leaves no port below it.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
from tp_runner_helpers import GlooShardedRunner

from draftforge.config import load_recipe
from draftforge.errors import InputError
from draftforge.splitserve import sglang_runner
from draftforge.splitserve.multinode import check_node_args, launch_plan
from draftforge.splitserve.placement import resolve_devices
from draftforge.splitserve.sglang_runner import FeatureRunnerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
TWO_NODE = ROOT / "recipes" / "ling3-flash-2node.yaml"


@pytest.mark.parametrize("overrides,node_lines", [
    (  # 4 target + 4 trainer ranks on each node
        ["split.target_ranks=[0,1,2,3,8,9,10,11]", "split.trainer_ranks=[4,5,6,7,12,13,14,15]"],
        ["node 0: ranks 0-7: target ranks 0-3, trainer ranks 4-7; local GPUs 0-7 (LOCAL_RANK)",
         "node 1: ranks 8-15: target ranks 8-11, trainer ranks 12-15; local GPUs 0-7 (LOCAL_RANK)"],
    ),
    (  # 6 target + 2 trainer ranks on each node, tensor-parallel pairs
        ["split.target_ranks=[0,1,2,3,4,5,8,9,10,11,12,13]", "split.trainer_ranks=[6,7,14,15]",
         "split.target_tensor_parallel=2"],
        ["node 0: ranks 0-7: target ranks 0-5, trainer ranks 6, 7; local GPUs 0-7 (LOCAL_RANK)",
         "node 1: ranks 8-15: target ranks 8-13, trainer ranks 14, 15; local GPUs 0-7 (LOCAL_RANK)"],
    ),
])
def test_two_eight_gpu_nodes_get_the_hand_computed_ranks_and_commands(overrides, node_lines):
    cfg = load_recipe(TWO_NODE, overrides)
    plan = launch_plan(cfg, "r.yaml", [], master_addr="10.0.0.1").splitlines()
    assert plan[1] == "  2 nodes x 8 processes; torchrun static rendezvous at 10.0.0.1:29500 (node 0)"
    assert plan[2:4] == [f"  {line}" for line in node_lines]
    for node in (0, 1):
        assert f"    which runs: torchrun --nnodes=2 --nproc_per_node=8 --node_rank={node} " \
               "--master_addr=10.0.0.1 --master_port=29500 --rdzv-conf=timeout=960 -m draftforge.train r.yaml" in plan
    assert check_node_args(cfg, node_rank=1, master_addr="10.0.0.1").ranks(1) == range(8, 16)
    with pytest.raises(InputError, match=r"\(0\.\.1; node n runs the 8 ranks from n\*8\), got 2"):
        check_node_args(cfg, node_rank=2, master_addr="10.0.0.1")


def _port_range(monkeypatch, text: str) -> None:
    """The kernel's ephemeral port range as free_port reads it."""
    real_open = open

    def fake_open(path, *args, **kwargs):
        if path == "/proc/sys/net/ipv4/ip_local_port_range":
            return io.StringIO(text)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(sglang_runner, "open", fake_open, raising=False)


def test_a_port_is_found_when_the_ephemeral_range_starts_low(monkeypatch):
    """``1024 65535`` (a common tuning) leaves no port below the range: the kernel picks one,
    instead of a refusal naming the empty range 22000..1023."""
    _port_range(monkeypatch, "1024\t65535\n")
    port = free_port()
    assert port > 0
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_every_port_below_the_ephemeral_range_is_a_candidate(monkeypatch):
    """With the range from 22100, the 100 ports 22000..22099 are the candidates, whatever
    this process's id (it only chooses where the search starts)."""
    _port_range(monkeypatch, "22100 60999")
    monkeypatch.setattr(os, "getpid", lambda: 500)
    port = free_port()
    assert 22000 <= port < 22100


class StubbornRunner(GlooShardedRunner):
    """Rank 0 handles SIGTERM and stays in its forward (as one stuck in a collective would,
    where its handler never runs); rank 1 fails as ``server_args["fail"]`` says."""

    def __init__(self, server_args: dict, *, tp_rank: int = 0) -> None:
        super().__init__(server_args, tp_rank=tp_rank)
        if tp_rank == 0:
            signal.signal(signal.SIGTERM, lambda signum, frame: None)

    def features(self, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tp_rank == 0:
            time.sleep(600)
        return super().features(rows)


def test_a_child_that_outlives_sigterm_is_killed(monkeypatch):
    """Rank 1 fails while rank 0 outlives SIGTERM: the failure still leaves no child running."""
    monkeypatch.syspath_prepend(str(ROOT))  # the children import StubbornRunner from this file
    runner = FeatureRunnerProcess({"tp_size": 2, "fail": ["features", 1]}, runner_cls=StubbornRunner)
    processes = list(runner._processes)
    begin = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"rank 1 of 2\) failed while computing features"):
            runner.features([torch.tensor([3, 1, 4])])
        assert not any(process.is_alive() for process in processes)
        assert time.monotonic() - begin < 60
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()


def test_auto_blames_the_recipe_for_a_target_gpu_that_is_not_here(monkeypatch):
    """``--device auto`` takes split.target_devices: a GPU there that this machine lacks is
    the recipe's, not a --device the user did not give."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(InputError, match=r"--device auto: the recipe's first target group runs on GPU\(s\) "
                                         r"\[4, 5, 6, 7\] \(split.target_devices, else its ranks' LOCAL_RANK\), "
                                         r"but 4 GPU\(s\) are visible here, so not \[4, 5, 6, 7\]"):
        resolve_devices("auto", [4, 5, 6, 7])
    assert resolve_devices("auto", [2, 3]) == ["cuda:2", "cuda:3"]
