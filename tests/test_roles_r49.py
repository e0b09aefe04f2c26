"""Review round 49: SIGTERM unwinds a rank as Ctrl-C does (a target rank closes its SGLang
instances), and the launcher's death still takes every rank with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import types

import pytest
from splitserve_helpers import tiny_recipe

from draftforge.config import load_recipe
from draftforge.splitserve import roles

ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def _child(script: str, **env: str) -> subprocess.CompletedProcess:
    """``script`` run by a Python process of its own (its signal handlers are its own)."""
    return subprocess.run([sys.executable, "-c", script], env=dict(ENV, **env), capture_output=True,
                          text=True, timeout=120)


def test_the_first_sigterm_unwinds_a_rank_and_a_later_one_kills_it():
    """A second SIGTERM within DUPLICATE_SIGTERM_S of the first is its copy (a group-wide
    SIGTERM reaches a rank directly and through the launcher, milliseconds apart) and is
    ignored (round 58: it killed ranks writing their interrupted summary); a later one kills."""
    script = (
        "import os, signal, time\n"
        "from draftforge.splitserve.roles import DUPLICATE_SIGTERM_S, Terminated, interrupt_once\n"
        "interrupt_once()\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
        "    print('not stopped', flush=True)\n"
        "except Terminated:\n"
        "    print('unwound', flush=True)\n"
        "    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(0.2)\n"
        "    print('the copy ignored', flush=True)\n"
        "    time.sleep(DUPLICATE_SIGTERM_S)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
        "    print('survived a later SIGTERM', flush=True)\n"
    )
    done = _child(script)
    assert done.stdout == "unwound\nthe copy ignored\n", done.stdout + done.stderr
    assert done.returncode == -signal.SIGTERM


def test_a_sigterm_after_ctrl_c_kills_at_once():
    """The launcher's SIGTERM comes 5 s after the Ctrl-C it passed on: a rank still unwinding
    from the Ctrl-C is killed by it, as before."""
    script = (
        "import os, signal, time\n"
        "from draftforge.splitserve.roles import interrupt_once\n"
        "interrupt_once()\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(30)\n"
        "except KeyboardInterrupt as stop:\n"
        "    print(type(stop).__name__, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
    )
    done = _child(script)
    assert done.stdout == "KeyboardInterrupt\n", done.stdout + done.stderr
    assert done.returncode == -signal.SIGTERM


@pytest.mark.parametrize("role", ["target", "trainer"])
def test_a_rank_stopped_by_sigterm_says_so_and_dies_of_it(tmp_path, monkeypatch, capsys, role):
    cfg = load_recipe(tiny_recipe(tmp_path))
    monkeypatch.setenv("RANK", "0" if role == "target" else "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(roles, "interrupt_once", lambda: None)
    lines: list[str] = []
    monkeypatch.setattr(roles, "RankContext", lambda cfg, rank, world, mode="train": types.SimpleNamespace(
        cfg=cfg, rank=rank, world=world, role=role, log=lines.append))

    def stopped(ctx, bench):
        raise roles.Terminated

    class Died(Exception):
        pass

    def die():
        raise Died

    monkeypatch.setattr(roles, f"_run_{role}", stopped)
    monkeypatch.setattr(roles, "die_of_sigterm", die)
    with pytest.raises(Died):
        roles.run_rank(cfg)
    assert lines == ["stopped on SIGTERM"]
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("where", ["run_rank", "starting"])
def test_after_unwinding_the_rank_is_killed_by_sigterm_so_the_launcher_sees_a_signal(where):
    """Exiting 143 would read as an exit status, and the launcher takes a rank killed by a
    signal for a failure's cause before those that exited. While the rank starts (before
    run_rank's own handler), train/__main__ says the same."""
    if where == "run_rank":
        body = ("from draftforge.splitserve.roles import Terminated, die_of_sigterm, interrupt_once\n"
                "interrupt_once()\n"
                "try:\n"
                "    os.kill(os.getpid(), signal.SIGTERM)\n"
                "    time.sleep(30)\n"
                "except Terminated:\n"
                "    print('unwound', flush=True)\n"
                "    die_of_sigterm()\n")
    else:
        body = ("from draftforge.splitserve import roles\n"
                "from draftforge.train import __main__ as rank_main\n"
                "def starting(args):\n"
                "    roles.interrupt_once()\n"
                "    os.kill(os.getpid(), signal.SIGTERM)\n"
                "    time.sleep(30)\n"
                "rank_main._run = starting\n"
                "rank_main.main(['recipe.yaml'])\n")
    done = _child("import os, signal, time\n" + body, RANK="3")
    assert done.returncode == -signal.SIGTERM, done.stdout + done.stderr
    if where == "starting":
        assert done.stderr.strip().endswith("[rank 3] stopped on SIGTERM"), done.stderr
    else:
        assert done.stdout == "unwound\n"


@pytest.mark.parametrize("backend, ranks, refused", [
    ("gloo", [0], False),  # node 0 runs the target rank alone: it runs on the CPU
    ("gloo", [1], True),   # node 1 runs the trainer, which needs the GPU train.device names
    ("gloo", None, True),  # every rank (one node, or a dry run's plan)
    ("auto", [0], True),   # auto picks gloo here and NCCL on a node with GPUs: still refused
])
def test_a_cpu_node_of_target_ranks_alone_is_not_refused_for_the_trainers_gpu(tmp_path, backend, ranks, refused):
    cfg = load_recipe(tiny_recipe(tmp_path, overrides={
        "split.num_nodes": 2, "split.comm_backend": backend, "train.device": "cuda"}))
    assert (cfg.split.world_size, cfg.split.target_ranks, cfg.split.trainer_ranks) == (2, [0], [1])
    problems = roles.split_problems(cfg, cuda_devices=0, ranks=ranks)
    named = [p for p in problems if p.startswith("train.device: cuda, but no CUDA GPU")]
    assert bool(named) == refused, problems


def _kept_script(loop: str, checks: str = "") -> str:
    """A rank's handler, an event loop made by ``loop`` that adds a SIGTERM handler inside
    ``sigterm_kept`` as SGLang's first request does, ``checks`` after the block, then a SIGTERM:
    prints 'unwound' and the calls the loop's handler got."""
    return (
        "import asyncio, signal\n"
        "from draftforge.splitserve.sglang_backend import sigterm_kept\n"
        "from draftforge.splitserve.roles import DUPLICATE_SIGTERM_S, Terminated, interrupt_once\n"
        "class Stubborn(asyncio.SelectorEventLoop):\n"
        "    def remove_signal_handler(self, sig):\n"
        "        return False  # as uvloop's, outside run()\n"
        "interrupt_once()\n"
        "ours = signal.getsignal(signal.SIGTERM)\n"
        f"loop = {loop}\n"
        "asyncio.set_event_loop(loop)\n"
        "graceful = []\n"
        "with sigterm_kept():\n"
        "    loop.add_signal_handler(signal.SIGTERM, lambda: graceful.append(1))\n"
        "    assert signal.getsignal(signal.SIGTERM) is not ours\n"
        "assert signal.getsignal(signal.SIGTERM) is ours\n"
        + checks +
        "try:\n"
        "    signal.raise_signal(signal.SIGTERM)\n"
        "except Terminated:\n"
        "    loop.run_until_complete(asyncio.sleep(0.05))  # the loop no longer acts on it\n"
        "    print('unwound', graceful, flush=True)\n"
    )


def test_the_sglang_backend_takes_sigterm_back_from_its_engine():
    """SGLang's first request installs, in the main thread, an event-loop SIGTERM handler (a
    graceful exit that later SIGKILLs the process tree); the rank's own handler, which closes
    the feature runner and the engine in order, is put back after each generate call.
    In a child process: the handlers of the test process stay as they are."""
    done = _child(_kept_script("asyncio.new_event_loop()",
                               "assert signal.SIGTERM not in loop._signal_handlers\n"))
    assert done.stdout == "unwound []\n", done.stdout + done.stderr


def test_the_engines_sigterm_handler_is_disarmed_where_its_loop_keeps_it():
    """uvloop (SGLang's event-loop policy) removes no signal handler while the loop is not
    running: the handle is cancelled, so the loop skips it if the signal reaches it later."""
    done = _child(_kept_script("Stubborn()"))
    assert done.stdout == "unwound []\n", done.stdout + done.stderr


def test_a_signal_during_generation_leaves_the_next_sigterm_fatal():
    """The rank's handler, run by a first SIGTERM inside the block, sets what the next one
    does (ignored as a copy within DUPLICATE_SIGTERM_S, fatal after: round 58); the block put
    the unwinding handler back over it, so that SIGTERM raised again mid-cleanup."""
    script = (
        "import os, signal, time\n"
        "from draftforge.splitserve.sglang_backend import sigterm_kept\n"
        "from draftforge.splitserve.roles import DUPLICATE_SIGTERM_S, Terminated, interrupt_once\n"
        "interrupt_once()\n"
        "try:\n"
        "    with sigterm_kept():\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(30)\n"
        "except Terminated:\n"
        "    print('unwound', getattr(signal.getsignal(signal.SIGTERM), 'after_stop', False), flush=True)\n"
        "    time.sleep(DUPLICATE_SIGTERM_S)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
    )
    done = _child(script)
    assert done.stdout == "unwound True\n", done.stdout + done.stderr
    assert done.returncode == -signal.SIGTERM


def test_another_nodes_trainers_are_not_counted_against_this_nodes_gpus(tmp_path):
    """Node 0 runs the target rank alone on a machine with one GPU; node 1's two trainers
    each take a GPU of node 1. Only a machine running those trainers is checked for them."""
    cfg = load_recipe(tiny_recipe(tmp_path, trainers=3, overrides={
        "split.num_nodes": 2, "split.comm_backend": "gloo", "train.device": "cuda", "split.world_size": 4,
        "split.target_ranks": [0, 1], "split.trainer_ranks": [2, 3]}))

    def named(ranks):
        return [p for p in roles.split_problems(cfg, cuda_devices=1, ranks=ranks)
                if "trainer ranks [2, 3] on node 1" in p]

    assert named([0, 1]) == []
    assert len(named([2, 3])) == 1
    assert len(named(None)) == 1
