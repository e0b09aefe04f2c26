"""Session 51: on several nodes torchrun gives an SGLang target's ranks the stop window the
one-node launcher gives them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from draftforge.config import load_recipe
from draftforge.splitserve import launch

TWO_NODE = Path(__file__).resolve().parents[1] / "recipes" / "ling3-flash-2node.yaml"


def _torchrun_env(monkeypatch, overrides: list[str], env: dict[str, str]) -> dict[str, str]:
    seen = []

    def fake_torchrun(command, *, env, **kwargs):
        seen.append(dict(env))
        return 0

    monkeypatch.setattr(launch, "run_torchrun", fake_torchrun)
    cfg = load_recipe(TWO_NODE, overrides)
    args = argparse.Namespace(recipe=str(TWO_NODE), overrides=overrides, node_rank=0, master_addr="10.0.0.5",
                              master_port=29500, max_restarts=None)
    env = {**env, launch.INPUT_ERROR_ENV: "/nonexistent/input-error"}
    assert launch._supervise(cfg, args, launch.node_layout(cfg), env, 0) == 0
    assert len(seen) == 1
    return seen[0]


def test_torchrun_waits_45_s_for_an_sglang_targets_ranks(monkeypatch):
    """The 45 s an SGLang target rank needs to close its feature runner (its processes finish
    their batch, up to 30 s, then get 10 s after their SIGTERM) was given by the one-node
    launcher only; torchrun SIGKILLed the ranks of a multi-node job 30 s after its SIGTERM."""
    assert load_recipe(TWO_NODE).target.backend == "sglang"
    env = _torchrun_env(monkeypatch, [], {})
    assert env[launch.SHUTDOWN_TIMEOUT_ENV] == "45"


@pytest.mark.parametrize("overrides,env,expected", [
    ([], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}, "120"),  # the user's own setting stays
    (["target.backend=hf"], {}, None),  # torchrun's default (30 s) is above the hf target's 5
])
def test_torchrun_keeps_a_shutdown_timeout_given_or_not_needed(monkeypatch, overrides, env, expected):
    assert _torchrun_env(monkeypatch, overrides, env).get(launch.SHUTDOWN_TIMEOUT_ENV) == expected
