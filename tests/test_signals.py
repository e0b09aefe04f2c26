"""Stopping a command stops everything it started: SIGTERM to ``data regenerate`` (its
worker processes), to ``demo`` (the training job of its running stage) and to a node of a
multi-node ``train`` (torchrun and its ranks); a regeneration worker dies with its parent."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from regenerate_helpers import SETTINGS
from splitserve_helpers import PYTHON, ROOT, free_port, tiny_recipe

from draftforge.data.answer_workers import _work

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _descendants(pid: int) -> dict[int, str]:
    """Every living process below ``pid`` (torchrun's ranks too, in sessions of their own),
    with its command line."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (ppid := _parent(int(entry))) is not None:
            children.setdefault(ppid, []).append(int(entry))
    found, todo = {}, list(children.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            found[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        todo += children.get(child, [])
    return {p: cmd for p, cmd in found.items() if _alive(p)}


def _training_ranks(pid: int) -> list[int]:
    """The ``draftforge.train`` ranks below ``pid``: not the processes a rank forks itself
    (torch.compile's workers carry the rank's command line)."""
    train = {p for p, cmd in _descendants(pid).items() if "-m draftforge.train " in cmd}
    return [p for p in train if _parent(p) not in train]


@pytest.fixture()
def reap():
    """Record processes a test starts; whatever of them a failed test left running is killed."""
    started: list[int] = []
    yield started.extend
    for pid in started:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _start(command, logs: Path) -> subprocess.Popen:
    """``command`` in a session of its own (as a scheduler or a service manager starts it),
    its output into files: a pipe would keep a test waiting on whatever outlives it."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(logs / "out.log", "w") as out, open(logs / "err.log", "w") as err:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    process.logs = logs
    return process


def _stderr(process: subprocess.Popen) -> str:
    return (process.logs / "err.log").read_text()


def _stop(process: subprocess.Popen, timeout: float) -> str:
    """SIGTERM to the command only, as a scheduler's stop sends it; its stderr once it ended."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise AssertionError(f"still running {timeout:g} s after SIGTERM\n{_stderr(process)[-3000:]}") from None
    return _stderr(process)


def _wait_for(what: str, check, process: subprocess.Popen, timeout: float):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if process.poll() is not None or time.monotonic() > deadline:
            left = _descendants(process.pid)
            process.kill()
            process.wait()
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"no {what} after {timeout:g} s (exit status {process.returncode})\n"
                                 f"{_stderr(process)[-3000:]}")
        time.sleep(0.2)
    return found


def _assert_all_end(pids, within: float) -> None:
    deadline = time.monotonic() + within
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"processes {left} still running {within:g} s after their parent ended")


# -- regeneration workers --------------------------------------------------------------


@pytest.mark.parametrize("closed", ["before it is ready", "while it waits for a batch"])
def test_a_worker_whose_parent_went_away_exits_quietly(capfd, closed):
    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    build = functools.partial(types.SimpleNamespace, name="fake-target")
    worker = context.Process(target=_work, args=(build, SETTINGS, child_end, True, os.getpid()))
    worker.start()
    child_end.close()
    if closed == "while it waits for a batch":
        assert parent_end.recv() == ("ready", "fake-target")
    parent_end.close()
    worker.join(timeout=30)
    assert worker.exitcode == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


KILLED_PARENT_DRIVER = """
import functools, sys, time
sys.path.insert(0, {tests!r})
from regenerate_helpers import SETTINGS, make_prompts
from draftforge.data.answer_workers import WorkerPool
if __name__ == "__main__":
    # workers that take five minutes to build their target
    pool = WorkerPool(functools.partial(time.sleep, 300), 2, "fake-target")
    for _ in pool.answer_batches([(0, make_prompts(3)), (1, make_prompts(3))], SETTINGS):
        pass
"""


def test_the_workers_die_with_a_killed_parent(tmp_path, reap):
    driver = tmp_path / "driver.py"
    driver.write_text(KILLED_PARENT_DRIVER.format(tests=str(Path(__file__).parent)))
    process = _start([sys.executable, str(driver)], tmp_path)
    workers = _wait_for("two workers", lambda: [
        p for p, cmd in _descendants(process.pid).items() if "spawn_main" in cmd and "--multiprocessing-fork" in cmd
    ][:2] if len(_descendants(process.pid)) >= 3 else None, process, 60)
    reap(workers)
    time.sleep(1.5)  # into their five-minute build
    process.kill()  # no chance to stop them itself
    process.wait()
    _assert_all_end(workers, within=10)


@pytest.mark.integration  # the random target borrows SmolLM2's tokenizer
def test_sigterm_stops_regenerate_and_its_workers(tmp_path, reap):
    recipe = tiny_recipe(tmp_path, num_conversations=1000, overrides={
        "data.regenerate": True, "data.num_samples": 1000, "target.generation.max_new_tokens": 32})
    partial = tmp_path / "run" / "regenerated.jsonl.partial"
    process = _start([PYTHON, "-m", "draftforge", "data", "regenerate", str(recipe), "--workers", "2",
                      "--no-progress"], tmp_path)
    _wait_for("answered batch", lambda: partial.exists() and partial.read_text().count("\n") >= 4,
              process, 60)
    started = _descendants(process.pid)
    reap(started)
    assert len(started) >= 2, started  # the two workers (and multiprocessing's resource tracker)
    err = _stop(process, timeout=30)
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped on SIGTERM; rerun the same command to continue" in err
    assert "Traceback" not in err and "leaked" not in err, err
    _assert_all_end(started, within=10)
    assert partial.read_text().count("\n") % 4 == 0  # whole batches kept for the rerun


# -- the demo and a multi-node training job ----------------------------------------------


@pytest.mark.integration
def test_sigterm_to_the_demo_stops_its_training_job(tmp_path, reap):
    # no regeneration: the demo goes straight to training, for longer than the test waits
    recipe = tiny_recipe(tmp_path, steps=10_000)
    process = _start([PYTHON, "-m", "draftforge", "demo", str(recipe)], tmp_path)
    ranks = _wait_for("training ranks", lambda: _training_ranks(process.pid)
                      if (tmp_path / "run" / "config.yaml").exists() else None, process, 90)
    assert len(ranks) == 2, ranks
    started = _descendants(process.pid)  # the train launcher too
    reap(started)
    err = _stop(process, timeout=40)
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "draftforge demo: stopped on SIGTERM" in err
    _assert_all_end(started, within=10)


def test_sigterm_to_a_node_stops_its_torchrun(tmp_path, reap):
    """Node 1 of two whose node 0 never answers: torchrun waits for it in the rendezvous,
    for many minutes, and (before the fix) long after its launcher ended."""
    recipe = tiny_recipe(tmp_path, overrides={"split.num_nodes": 2})
    process = _start([PYTHON, "-m", "draftforge", "train", str(recipe), "--node-rank", "1",
                      "--master-addr", "192.0.2.2", "--master-port", str(free_port())], tmp_path)
    _wait_for("torchrun", lambda: [p for p, cmd in _descendants(process.pid).items()
                                   if "-m torch.distributed.run " in cmd], process, 60)
    time.sleep(2)  # into its rendezvous
    started = _descendants(process.pid)
    reap(started)
    err = _stop(process, timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "draftforge train: stopped on SIGTERM" in err, err[-3000:]
    _assert_all_end(started, within=10)
