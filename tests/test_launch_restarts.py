"""``draftforge train`` restarts a failed job (split.restart_target), but never one whose rank
refused its input: torchrun exits 1 whatever its ranks' statuses, so such a rank leaves the
launcher a marker (``roles.note_input_error``) before it exits with status 2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from splitserve_helpers import tiny_recipe

from draftforge.splitserve import launch
from draftforge.splitserve.launch import DEFAULT_RESTARTS, INPUT_ERROR_ENV, RESTART_ENV
from draftforge.splitserve.launch import main as train_main

ROOT = Path(__file__).resolve().parents[1]
TWO_NODES = ["--node-rank", "1", "--master-addr", "10.0.0.5"]


def fake_job(monkeypatch, name: str, statuses: list[int], *, refuse: bool = False) -> list[dict]:
    """Replace ``launch.<name>`` (run_torchrun or run_ranks) by a job that ends with the next of
    ``statuses``; with ``refuse`` a rank refuses its input, as run_rank does. Returns the
    environment of each start."""
    from draftforge.errors import InputError
    from draftforge.splitserve.roles import note_input_error

    starts = []

    def job(*args, env, **kwargs):
        starts.append(dict(env))
        if refuse:  # what a rank of the job does, in the environment the launcher gave it
            with pytest.MonkeyPatch.context() as rank:
                rank.setattr(os, "environ", {**env, "RANK": "1"})
                note_input_error(InputError("data.train_files convs.jsonl: line 3: no messages"))
        return statuses[len(starts) - 1]

    monkeypatch.setattr(launch, name, job)
    return starts


@pytest.mark.parametrize("restarts", [[], ["--max-restarts", "0"]])
def test_a_node_whose_rank_refused_its_input_is_not_restarted(restarts, tmp_path, monkeypatch, capsys):
    recipe = tiny_recipe(tmp_path, overrides={"split.num_nodes": 2, "split.restart_target": True})
    starts = fake_job(monkeypatch, "run_torchrun", [1] * 4, refuse=True)
    assert train_main([str(recipe), *TWO_NODES, *restarts]) == 2
    assert len(starts) == 1
    err = capsys.readouterr().err
    assert "restart 1 of" not in err
    assert "the job failed (exit status 2)" in err.splitlines()[-1]
    marker = Path(starts[0][INPUT_ERROR_ENV])
    assert not marker.parent.exists()  # the launcher's folder is gone with the job


def test_a_node_whose_ranks_failed_otherwise_is_restarted(tmp_path, monkeypatch, capsys):
    recipe = tiny_recipe(tmp_path, overrides={"split.num_nodes": 2, "split.restart_target": True})
    starts = fake_job(monkeypatch, "run_torchrun", [1] * (DEFAULT_RESTARTS + 1))
    assert train_main([str(recipe), *TWO_NODES]) == 1
    assert len(starts) == DEFAULT_RESTARTS + 1
    assert [start.get(RESTART_ENV) for start in starts] == [None, *map(str, range(1, DEFAULT_RESTARTS + 1))]
    assert f"restart {DEFAULT_RESTARTS} of {DEFAULT_RESTARTS}" in capsys.readouterr().err
    # a failure, then a job that finishes: no more restarts
    starts = fake_job(monkeypatch, "run_torchrun", [1, 0])
    assert train_main([str(recipe), *TWO_NODES]) == 0
    assert len(starts) == 2


def test_one_node_whose_rank_refused_its_input_is_not_restarted(tmp_path, monkeypatch):
    """On one node the supervisor's status is the rank taken for the cause, which may be
    another rank killed at that moment (status 128 + 9): the marker still says it."""
    recipe = tiny_recipe(tmp_path, overrides={"split.restart_target": True})
    starts = fake_job(monkeypatch, "run_ranks", [137] * 4, refuse=True)
    assert train_main([str(recipe)]) == 2
    assert len(starts) == 1
    starts = fake_job(monkeypatch, "run_ranks", [137] * 4)
    assert train_main([str(recipe), "--max-restarts", "2"]) == 137
    assert len(starts) == 3


def test_a_rank_that_refuses_its_input_leaves_the_marker_and_exits_2(tmp_path):
    """run_rank itself: an InputError in the role writes the marker, then exits with status 2."""
    recipe = tiny_recipe(tmp_path)
    marker = tmp_path / "launcher" / "input-error"
    marker.parent.mkdir()
    script = (
        "import sys\n"
        "from draftforge.config import load_recipe\n"
        "from draftforge.errors import InputError\n"
        "from draftforge.splitserve import roles\n"
        "class Context:\n"
        "    def __init__(self, cfg, rank, world, mode):\n"
        "        self.role, self.log = 'target', lambda message: print(message, file=sys.stderr)\n"
        "def refuse(ctx, bench):\n"
        "    raise InputError('data.train_files convs.jsonl: line 3: no messages')\n"
        "roles.RankContext, roles._run_target = Context, refuse\n"
        "roles.run_rank(load_recipe(sys.argv[1]))\n"
    )
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", **{INPUT_ERROR_ENV: str(marker)})
    done = subprocess.run([sys.executable, "-c", script, str(recipe)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert marker.read_text() == "rank 0: data.train_files convs.jsonl: line 3: no messages\n"
    assert [p.name for p in marker.parent.iterdir()] == ["input-error"]  # no temporary left
    # started by hand (no launcher, no variable): the same status, no file anywhere
    marker.unlink()
    del env[INPUT_ERROR_ENV]
    done = subprocess.run([sys.executable, "-c", script, str(recipe)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert not marker.exists()


@pytest.mark.distributed
def test_the_marker_reaches_the_launcher_through_real_torchrun(tmp_path, monkeypatch, capsys):
    """torchrun passes the launcher's environment to its ranks and exits 1 when rank 1 exits
    with status 2 (the status alone is lost); the marker rank 1 leaves still stops restarts."""
    recipe = tiny_recipe(tmp_path, overrides={"split.num_nodes": 2, "split.restart_target": True})
    rank = tmp_path / "rank.py"
    rank.write_text(
        "import os, sys\n"
        "from draftforge.errors import InputError\n"
        "from draftforge.splitserve.roles import note_input_error\n"
        "if os.environ['RANK'] == '1':\n"
        "    note_input_error(InputError('data.train_files convs.jsonl: line 3: no messages'))\n"
        "    sys.exit(2)\n"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(rank)]
    monkeypatch.setattr(launch, "multinode_torchrun_command", lambda *a, **k: command)
    statuses = []
    real = launch.run_torchrun
    monkeypatch.setattr(launch, "run_torchrun", lambda *a, **k: statuses.append(real(*a, **k)) or statuses[-1])
    assert train_main([str(recipe), *TWO_NODES]) == 2
    assert statuses == [1]
    assert "a rank refused its input (exit status 2)" in capsys.readouterr().err
