"""Review round 32 of the launcher (``draftforge train``): splitserve.launch, supervisor,
core.signals and core.cli."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from test_launch_r27 import _kill_pid_in


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (not gone, not a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


# --------------------------------------------------------------------------- torchrun killed

# torchrun as the out-of-memory killer leaves it: it started its rank in a session of its own
# (torch's SubprocessHandler, start_new_session) and is then killed outright, with no chance to
# stop the rank
_TORCHRUN_KILLED = """
import os, signal, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import os, sys, time\\n"
                         "open(sys.argv[1], 'w').write(str(os.getpid()))\\n"
                         "time.sleep(120)", sys.argv[1]], start_new_session=True)
deadline = time.monotonic() + 60
while not (os.path.exists(sys.argv[1]) and open(sys.argv[1]).read()) and time.monotonic() < deadline:
    time.sleep(0.02)
while not os.path.exists(sys.argv[1] + ".seen") and time.monotonic() < deadline:
    time.sleep(0.02)  # until the launcher has seen its rank (it looks every 0.5 s)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_ranks_of_a_killed_torchrun_do_not_outlive_it(tmp_path, capsys, monkeypatch):
    """torchrun killed outright (SIGKILL: the out-of-memory killer, `kill -9`) left its ranks,
    in sessions of their own, running as orphans holding their GPUs, ports and the run's
    lock; the launcher then restarted the job beside them (whose trainer rank 0 was refused
    the lock, and the node stopped, "a rank refused its input")."""
    from draftforge.splitserve import launch
    from draftforge.splitserve.launch import run_torchrun

    pid_file = tmp_path / "rank.pid"
    script = tmp_path / "torchrun.py"
    script.write_text(_TORCHRUN_KILLED)
    real_started = launch._started

    def started(pid: int):
        """The launcher's look at a child of torchrun: once it has seen the rank, torchrun dies."""
        found = real_started(pid)
        if found is not None and pid_file.exists() and pid_file.read_text() == str(pid):
            pid_file.with_name(pid_file.name + ".seen").touch()
        return found

    monkeypatch.setattr(launch, "_started", started)
    try:
        status = run_torchrun([sys.executable, str(script), str(pid_file)], env=os.environ, nproc=1)
        assert status == 128 + signal.SIGKILL
        rank = int(pid_file.read_text())
        deadline = time.monotonic() + 10
        while _alive(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(rank), "torchrun's rank outlived it"
        err = capsys.readouterr().err
        assert "killed by SIGKILL" in err and str(rank) in err, err
    finally:
        _kill_pid_in(pid_file)


# --------------------------------------------------------------------------- the restart's line


def _fake_ranks(monkeypatch, statuses: list[int]) -> list[dict]:
    """``launch.run_ranks`` replaced by a job that ends with the next of ``statuses``."""
    from draftforge.splitserve import launch

    starts: list[dict] = []

    def job(*args, env, **kwargs):
        starts.append(dict(env))
        return statuses[len(starts) - 1]

    monkeypatch.setattr(launch, "run_ranks", job)
    return starts


def _restart_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "; restart " in line]


def test_a_restart_before_the_first_checkpoint_says_the_job_starts_over(tmp_path, monkeypatch,
                                                                         capsys):
    """A job that failed before its first checkpoint was restarted "continuing from the newest
    checkpoint in RUN_DIR", where there was none: the restart started over."""
    from splitserve_helpers import tiny_recipe

    from draftforge.splitserve.launch import main as train_main
    from draftforge.train import checkpoint as ckpt

    recipe = tiny_recipe(tmp_path, overrides={"split.restart_target": True})
    run_dir = tmp_path / "run"
    assert ckpt.find_resume(run_dir, "auto") is None  # nothing to continue from
    starts = _fake_ranks(monkeypatch, [1, 0])
    assert train_main([str(recipe)]) == 0
    assert len(starts) == 2
    lines = _restart_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    assert "newest checkpoint" not in lines[0], lines
    assert f"starting over: no checkpoint was written yet in {run_dir}" in lines[0], lines
    # with one, the restart continues from it, and says so
    from draftforge.splitserve import launch

    monkeypatch.setattr(launch, "preflight", lambda cfg, **kwargs: None)  # which would read the checkpoint
    monkeypatch.setattr(ckpt, "find_resume", lambda *a, **k: run_dir / "checkpoints" / "step_4")
    _fake_ranks(monkeypatch, [1, 0])
    assert train_main([str(recipe)]) == 0
    lines = _restart_lines(capsys.readouterr().err)
    assert lines and f"continuing from the newest checkpoint in {run_dir}" in lines[0], lines


def test_restarts_asked_with_max_restarts_are_not_put_down_to_restart_target(tmp_path, monkeypatch,
                                                                            capsys):
    """--max-restarts without split.restart_target: the restart's line said "(split.restart_target)",
    a setting the recipe does not have."""
    from splitserve_helpers import tiny_recipe

    from draftforge.splitserve.launch import main as train_main

    recipe = tiny_recipe(tmp_path)
    starts = _fake_ranks(monkeypatch, [1, 1])
    assert train_main([str(recipe), "split.restart_target=false", "--max-restarts", "1"]) == 1
    assert len(starts) == 2
    lines = _restart_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "restart 1 of 1 (--max-restarts)" in lines[0], lines
    assert "split.restart_target" not in lines[0], lines


# --------------------------------------------------------------------------- a stop put off by a finalizer


def test_a_stop_put_off_by_a_finalizer_runs_once_and_gives_sigalrm_back():
    """A signal landing in a ``__del__`` is put off 10 ms (SIGALRM). When a second one came
    meanwhile and was handled (a rank gets Ctrl-C twice: the terminal's and the launcher's),
    the first ran its handler once more, 10 ms later: a second KeyboardInterrupt in the middle
    of the first one's cleanup, where interrupt_once promises to ignore the ones after it. And
    the SIGALRM handler stayed installed, so any later SIGALRM raised the stop again."""
    from draftforge.signals import outside_finalizers

    if not hasattr(signal, "setitimer"):
        pytest.skip("needs setitimer")
    calls: list[int] = []

    def handler(signum, frame):
        calls.append(signum)

    guarded = outside_finalizers(handler)

    class Finalized:
        def __del__(self):
            guarded(signal.SIGUSR1, sys._getframe())  # the signal lands here: put off

    alarm = signal.getsignal(signal.SIGALRM)
    usr1 = signal.signal(signal.SIGUSR1, guarded)
    try:
        Finalized()
        assert calls == []
        guarded(signal.SIGUSR1, sys._getframe())  # the second one, outside any finalizer
        assert calls == [signal.SIGUSR1]
        time.sleep(0.2)  # the put-off one's alarm has come
        assert calls == [signal.SIGUSR1], "the stop ran twice"
        assert signal.getsignal(signal.SIGALRM) == alarm
        # alone, the put-off one still runs once, after the finalizer
        Finalized()
        time.sleep(0.2)
        assert calls == [signal.SIGUSR1] * 2
        assert signal.getsignal(signal.SIGALRM) == alarm
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGUSR1, usr1)
        signal.signal(signal.SIGALRM, alarm)


# --------------------------------------------------------------------------- torchrun's PET_ variables


def test_a_nodes_torchrun_takes_no_rendezvous_from_pet_variables(tmp_path, monkeypatch, capsys):
    """torchrun reads each option it is not given from PET_<OPTION>, which a Kubeflow PyTorchJob
    sets: with PET_RDZV_BACKEND=c10d and PET_RDZV_ENDPOINT a node's torchrun left the static
    rendezvous at --master-addr for a dynamic one elsewhere, which hands out the ranks in join
    order (the split's groups scattered over the nodes), and PET_MAX_RESTARTS restarted the
    ranks behind the launcher's back."""
    from splitserve_helpers import tiny_recipe
    from torch.distributed.run import parse_args

    from draftforge.splitserve import launch

    recipe = tiny_recipe(tmp_path, trainers=3, overrides={"split.num_nodes": 2})
    pet = {"PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "10.9.9.9:29400",
           "PET_MAX_RESTARTS": "3", "PET_NNODES": "1:4"}
    for key, value in pet.items():
        monkeypatch.setenv(key, value)
    seen: list[tuple[list[str], dict]] = []

    def torchrun(command, *, env, **kwargs):
        seen.append((list(command), dict(env)))
        return 0

    monkeypatch.setattr(launch, "run_torchrun", torchrun)
    assert launch.main([str(recipe), "--node-rank", "1", "--master-addr", "10.0.0.5"]) == 0
    [(command, env)] = seen
    assert command[1:3] == ["-m", "torch.distributed.run"]
    # what torchrun makes of its command line in that environment
    monkeypatch.setattr(os, "environ", env)
    args = parse_args(command[3:])
    assert args.rdzv_backend == "static" and args.rdzv_endpoint == "", (args.rdzv_backend,
                                                                        args.rdzv_endpoint)
    assert (args.master_addr, args.node_rank, args.nnodes, args.max_restarts) == ("10.0.0.5", 1, "2", 0)
    monkeypatch.undo()
    assert "PET_RDZV_BACKEND" in capsys.readouterr().err  # the launcher says it ignored them
