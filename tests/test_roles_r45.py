"""Review round 45 of a rank's failure handling (splitserve/roles.py)."""

from __future__ import annotations

import types

import pytest
from splitserve_helpers import tiny_recipe

from draftforge.config import load_recipe
from draftforge.splitserve import roles


class _Exited(Exception):
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


@pytest.mark.parametrize("trainers, rank, named", [
    (2, 1, "with trainer rank 2)"),
    (3, 2, "with trainer ranks [1, 3])"),
])
def test_a_trainer_whose_group_collective_lost_a_rank_names_the_trainer_ranks(
        tmp_path, monkeypatch, capsys, trainers, rank, named):
    """A trainer whose collective of the trainer group broke (gloo: 'Connection closed by peer
    [127.0.0.1]:PORT', an address, no rank) stopped saying only 'a trainer rank died', where the
    rank that died is the other trainer of a two-trainer group. It names the group's other
    ranks now: the one that died or hung, with two trainers."""
    cfg = load_recipe(tiny_recipe(tmp_path, trainers=trainers))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(1 + trainers))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(roles, "interrupt_once", lambda: None)
    lines: list[str] = []
    monkeypatch.setattr(roles, "RankContext", lambda cfg, rank, world, mode="train": types.SimpleNamespace(
        cfg=cfg, rank=rank, world=world, role="trainer", log=lines.append))

    def collective_lost_a_rank(ctx, bench):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                           "by peer [127.0.0.1]:10146. This is typically caused by a remote worker "
                           "crashing.")

    def exit_now(code):
        raise _Exited(code)

    monkeypatch.setattr(roles, "_run_trainer", collective_lost_a_rank)
    monkeypatch.setattr(roles.os, "_exit", exit_now)
    with pytest.raises(_Exited) as info:
        roles.run_rank(cfg)
    assert info.value.code == roles.EXIT_PEER_DIED
    stop = next(line for line in lines if line.startswith("stopping: "))
    assert stop.startswith("stopping: a trainer rank died or closed its connection: [")
    assert stop.endswith(f"(while in a collective of the trainer group {named}"), stop
    assert "Traceback" not in capsys.readouterr().err
