"""Round 59: multi-node starts. The static rendezvous waits a bounded, announced time (not
torch's silent 900 s per attempt); loopback and wildcard aliases are refused; a trainers-only
node needs no data files; the plan and the advice of a node without trainers say what holds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from splitserve_helpers import free_port, tiny_recipe

from draftforge.config import load_recipe
from draftforge.data.formats import DataFormatError
from draftforge.errors import InputError
from draftforge.splitserve import launch
from draftforge.splitserve.multinode import (
    check_node_args,
    is_loopback,
    is_unspecified,
    launch_plan,
    multinode_torchrun_command,
    node_layout,
    rendezvous_timeout_s,
)

ROOT = Path(__file__).resolve().parents[1]
NODE1 = ["--node-rank", "1", "--master-addr", "10.0.0.5", "--master-port", "29511"]


# 1. the rendezvous timeout --------------------------------------------------------------

@pytest.mark.parametrize(("peer", "expected"), [(1.0, 61), (120.2, 181), (900.0, 960)])
def test_the_rendezvous_waits_split_peer_timeout_s_and_a_minute(peer, expected, tmp_path):
    """A node may notice a silent peer only after peer_timeout_s, then stop its ranks (torchrun's
    grace, up to 45 s) and restart: the others wait for that, plus a margin, 60 s in all."""
    cfg = load_recipe(tiny_recipe(tmp_path, overrides={"split.num_nodes": 2, "split.peer_timeout_s": peer}))
    assert rendezvous_timeout_s(cfg.split) == expected


def test_torchrun_takes_the_timeout_for_its_static_rendezvous(tmp_path, monkeypatch):
    """The command line's --rdzv-conf=timeout reaches the static rendezvous's configuration
    (torch's default, without it, is 900 s)."""
    from torch.distributed.run import config_from_args, parse_args

    cfg = load_recipe(tiny_recipe(tmp_path, overrides={"split.num_nodes": 2}))
    command = multinode_torchrun_command("r.yaml", [], node_layout(cfg), node_rank=1,
                                         master_addr="10.0.0.5", master_port=29511,
                                         rendezvous_timeout=75)
    assert "--rdzv-conf=timeout=75" in command
    for key in [key for key in os.environ if key.startswith("PET_")]:
        monkeypatch.delenv(key)
    config, _, _ = config_from_args(parse_args(command[3:]))
    assert config.rdzv_backend == "static"
    assert int(config.rdzv_configs["timeout"]) == 75
    assert config.rdzv_configs["rank"] == 1


def _fake_torchrun(monkeypatch, statuses, calls):
    def torchrun(command, *, env, seen=None, **kwargs):
        calls.append(list(command))
        return statuses[len(calls) - 1]

    monkeypatch.setattr(launch, "run_torchrun", torchrun)


def test_each_attempt_says_where_and_how_long_it_waits(tmp_path, monkeypatch, capsys):
    recipe = tiny_recipe(tmp_path, overrides={"split.num_nodes": 2, "split.peer_timeout_s": 90})
    calls: list = []
    _fake_torchrun(monkeypatch, [0], calls)
    assert launch.main([str(recipe), *NODE1]) == 0
    err = capsys.readouterr().err
    assert "--rdzv-conf=timeout=150" in calls[0]
    assert ("draftforge train: node 1: waiting up to 150 s for the other 1 node at 10.0.0.5:29511 "
            "(node 0's rendezvous") in err, err
    assert "rendezvous at 10.0.0.5:29511 was not met" not in err


def test_a_timed_out_rendezvous_says_where_it_waited_and_what_to_check(tmp_path, monkeypatch, capsys):
    """torchrun fails with a store traceback ('timed out'); the launcher, seeing that no rank
    of its node started, says which address and port it waited on."""
    recipe = tiny_recipe(tmp_path, overrides={"split.num_nodes": 2})
    monkeypatch.setattr(launch, "rendezvous_timeout_s", lambda split: 0)  # "waited" the whole timeout
    calls: list = []
    _fake_torchrun(monkeypatch, [1], calls)
    assert launch.main([str(recipe), *NODE1]) == 1
    err = capsys.readouterr().err
    assert "node 1: node 0's rendezvous at 10.0.0.5:29511 was not met after 0 s" in err, err
    assert "nc -zv 10.0.0.5 29511" in err


def test_a_rank_that_ran_is_no_rendezvous_failure(tmp_path, monkeypatch, capsys):
    recipe = tiny_recipe(tmp_path, overrides={"split.num_nodes": 2})
    monkeypatch.setattr(launch, "rendezvous_timeout_s", lambda split: 0)

    def torchrun(command, *, env, seen=None, **kwargs):
        seen[1234] = "5678"  # a rank torchrun started
        return 1

    monkeypatch.setattr(launch, "run_torchrun", torchrun)
    assert launch.main([str(recipe), *NODE1]) == 1
    assert "was not met" not in capsys.readouterr().err


def test_a_node_alone_fails_after_the_rendezvous_timeout_not_900_s(tmp_path):
    """A real torchrun of node 1 with no node 0: it gives up after the timeout it was given."""
    cfg = load_recipe(tiny_recipe(tmp_path, overrides={"split.num_nodes": 2}))
    command = multinode_torchrun_command(str(tmp_path / "never-read.yaml"), [], node_layout(cfg),
                                         node_rank=1, master_addr="127.0.0.1",
                                         master_port=free_port(), rendezvous_timeout=3)
    env = {key: value for key, value in os.environ.items() if not key.startswith("PET_")}
    began = time.monotonic()
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - began
    assert done.returncode != 0
    assert "timed out" in done.stderr or "TimeoutError" in done.stderr or "DistNetworkError" in done.stderr, \
        done.stderr[-2000:]
    assert took < 90, took


# 2. loopback and wildcard aliases -------------------------------------------------------

LOOPBACK_ALIASES = ["127.1", "127.0.0.1", "0x7f.1", "2130706433", "::ffff:127.0.0.1",
                    "[::ffff:127.0.0.1]", "::1", "localhost", "ip6-localhost"]
WILDCARD_ALIASES = ["0", "0.0.0.0", "::", "::ffff:0.0.0.0"]


@pytest.mark.parametrize("address", LOOPBACK_ALIASES)
def test_loopback_aliases_are_loopback(address):
    assert is_loopback(address) and not is_unspecified(address)


@pytest.mark.parametrize("address", WILDCARD_ALIASES)
def test_wildcard_aliases_are_unspecified(address):
    assert is_unspecified(address) and not is_loopback(address)


@pytest.mark.parametrize("address", ["10.0.0.5", "192.0.2.2", "fd00::2", "node0", "gpu-7.cluster"])
def test_cluster_addresses_are_neither(address):
    assert not is_loopback(address) and not is_unspecified(address)


@pytest.mark.parametrize("address", LOOPBACK_ALIASES + WILDCARD_ALIASES)
def test_a_multi_node_start_refuses_every_alias(address, tmp_path):
    cfg = load_recipe(tiny_recipe(tmp_path, overrides={"split.num_nodes": 2}))
    with pytest.raises(InputError, match="--master-addr"):
        check_node_args(cfg, node_rank=1, master_addr=address)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="loopback interface name")
def test_a_one_node_job_on_127_1_keeps_its_sockets_on_lo(monkeypatch, tmp_path):
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    env = launch.launch_env("127.1")
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["NCCL_SOCKET_IFNAME"] == "lo"
    cfg = load_recipe(tiny_recipe(tmp_path))
    plan = launch_plan(cfg, "r.yaml", [], master_addr="127.1")
    assert "127.1 (loopback only)" in plan and "opened on" not in plan


# 4. a trainers-only node ----------------------------------------------------------------

def _without_data(tmp_path, **overrides) -> Path:
    recipe = tiny_recipe(tmp_path, overrides={"split.num_nodes": 2, **overrides})
    (tmp_path / "convs.jsonl").unlink()  # on the target ranks' node only
    return recipe


def _missing_data(tmp_path) -> str:
    """The pattern of data.loading's own refusal of the deleted data file (not a raw traceback)."""
    return "^" + re.escape(f"data file not found: {tmp_path / 'convs.jsonl'}; check data.train_files") + "$"


def test_a_trainers_only_node_starts_without_the_data_files(tmp_path, monkeypatch):
    recipe = _without_data(tmp_path)
    calls: list = []
    _fake_torchrun(monkeypatch, [0], calls)
    assert launch.main([str(recipe), *NODE1]) == 0  # node 1: trainer rank 1 only
    assert len(calls) == 1


def test_the_target_node_still_checks_the_data_files(tmp_path, monkeypatch):
    recipe = _without_data(tmp_path)
    calls: list = []
    _fake_torchrun(monkeypatch, [0], calls)
    with pytest.raises(DataFormatError, match=_missing_data(tmp_path)):
        launch.main([str(recipe), "--node-rank", "0", "--master-addr", "10.0.0.5",
                     "--master-port", str(free_port())])
    assert not calls


def test_a_trainers_only_node_reads_the_data_for_a_bigram_init(tmp_path, monkeypatch):
    """train.markov_init: bigram counts the answers' bigrams on the trainer ranks."""
    recipe = _without_data(tmp_path, **{"train.markov_init": "bigram"})
    calls: list = []
    _fake_torchrun(monkeypatch, [0], calls)
    with pytest.raises(DataFormatError, match=_missing_data(tmp_path)):
        launch.main([str(recipe), *NODE1])
    assert not calls


# 5. the plan and a target node's advice -------------------------------------------------

def test_the_plan_names_one_local_process_as_such(tmp_path):
    cfg = load_recipe(tiny_recipe(tmp_path, overrides={"split.num_nodes": 2}))
    plan = launch_plan(cfg, "r.yaml", [], master_addr="10.0.0.5")
    assert "0-0" not in plan
    assert "local process 0 (LOCAL_RANK)" in plan
    assert "--rdzv-conf=timeout=120" in plan


def test_a_node_without_trainers_does_not_promise_a_checkpoint(tmp_path, monkeypatch, capsys):
    """Node 0 runs only the target: it cannot see whether the trainers' node wrote a
    checkpoint, so it does not say that a rerun continues from one."""
    recipe = tiny_recipe(tmp_path, overrides={"split.num_nodes": 2, "split.restart_target": True})
    calls: list = []
    _fake_torchrun(monkeypatch, [1, 1, 1, 1], calls)
    assert launch.main([str(recipe), "--node-rank", "0", "--master-addr", "10.0.0.5",
                        "--master-port", str(free_port())]) == 1
    err = capsys.readouterr().err
    restarts = [line for line in err.splitlines() if "; restart 1 of" in line]
    assert restarts and "starting over where none was written yet" in restarts[0], err
    assert "the same command starts over" in err.splitlines()[-1]
    hint = launch._stop_hint(load_recipe(recipe), node_layout(load_recipe(recipe)), 0, every_node=True)
    assert "starts over where none was written yet" in str(hint)


def test_the_recipe_keys_say_device_lists_are_one_machine_only():
    text = (ROOT / "recipes" / "README.md").read_text()
    for key in ("split.target_devices", "split.trainer_devices"):
        [row] = [line for line in text.splitlines() if line.startswith(f"| `{key}`")]
        assert "refused with num_nodes > 1" in row
