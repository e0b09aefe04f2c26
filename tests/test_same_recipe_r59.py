"""Every rank must resolve the same split and draft (splitserve/same_recipe.py).

A review ran two "nodes" with different overrides: both stopped only after the peer timeout,
each blaming the other ("sent nothing", "died or closed its connection"), and both advised
rerunning the same command. The ranks now compare their split and draft once they meet.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from draftforge.splitserve.same_recipe import SHOWN, recipe_differences

ROOT = Path(__file__).resolve().parents[1]


def _sections(**split):
    base = {"split": {"target_ranks": [0], "trainer_ranks": [1], "max_in_flight": 4},
            "draft": {"block_size": 8, "target_layer_ids": [1, 2]}}
    base["split"].update(split)
    return base


def test_identical_sections_pass_and_a_difference_names_rank_node_key_and_both_values():
    assert recipe_differences([_sections(), _sections(), _sections()], per_node=1) is None
    other = _sections(max_in_flight=8)
    other["draft"]["target_layer_ids"] = [1, 3]
    message = recipe_differences([_sections(), _sections(), other, _sections()], per_node=2)
    assert message.startswith("the ranks do not run the same recipe: the split and draft sections "
                              "must be the same on every rank, and these differ from rank 0's "
                              "(node 0): rank 2 (node 1): draft.target_layer_ids [1, 3] (rank 0: "
                              "[1, 2]); split.max_in_flight 8 (rank 0: 4). Start every node")
    assert "rank 1" not in message and "rank 3" not in message


def test_one_node_names_no_nodes_and_many_differences_are_counted_not_listed():
    many = _sections(**{f"k{i}": i for i in range(SHOWN + 3)})
    message = recipe_differences([_sections(), many])
    assert "(node" not in message
    assert message.count("(rank 0: None)") == SHOWN and ", and 3 more." in message


@pytest.mark.distributed
def test_two_nodes_given_different_overrides_both_refuse_at_once(tmp_path):
    """Node 1 adds an override node 0 lacks: both refuse (exit status 2) when they meet, naming
    the key, instead of running into the peer timeout."""
    from splitserve_helpers import free_port, tiny_recipe

    from draftforge.config import load_recipe
    from draftforge.splitserve.multinode import multinode_torchrun_command, node_layout

    recipe = tiny_recipe(tmp_path, steps=3, overrides={"split.num_nodes": 2, "split.peer_timeout_s": 120})
    layout = node_layout(load_recipe(recipe))
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    procs, logs = [], []
    for node, overrides in ((0, []), (1, ["split.max_in_flight=3"])):
        logs.append(tmp_path / f"node{node}.log")
        command = multinode_torchrun_command(str(recipe), overrides, layout, node_rank=node,
                                             master_addr="127.0.0.1", master_port=port)
        procs.append(subprocess.Popen(command, env=env, cwd=ROOT, stdout=logs[-1].open("w"),
                                      stderr=subprocess.STDOUT))
    try:
        codes = [proc.wait(timeout=100) for proc in procs]  # well inside the 120 s peer timeout
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    texts = [log.read_text() for log in logs]
    wanted = ("the ranks do not run the same recipe: the split and draft sections must be the same "
              "on every rank, and these differ from rank 0's (node 0): rank 1 (node 1): "
              "split.max_in_flight 3 (rank 0: ")
    for text in texts:
        assert wanted in text, text[-3000:]
    assert all(code != 0 for code in codes), (codes, texts[0][-2000:], texts[1][-2000:])
