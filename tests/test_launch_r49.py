"""Review round 49 of a node's torchrun (splitserve/launch.py): a first Ctrl-C or SIGTERM while
torchrun is still starting its ranks is passed on, not taken for a lost rank."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

# torchrun as it starts its ranks: the first is running, the second not started yet. On the
# launcher's signal it stops the rank it has and exits as torchrun does.
_STARTING_TORCHRUN = """
import signal, subprocess, sys, time
def stopping(signum, frame):
    open(sys.argv[1] + ".stopping", "w").close()
    rank.terminate()
    rank.wait()
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stopping)
signal.signal(signal.SIGINT, stopping)
rank = subprocess.Popen([sys.executable, "-c", "import os, sys, time\\n"
                         "open(sys.argv[1], 'w').write(str(os.getpid()))\\n"
                         "time.sleep(120)", sys.argv[1]], start_new_session=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_signal_while_torchrun_starts_its_ranks_stops_it_gently(tmp_path, capsys, monkeypatch):
    """One rank of two running counted as 'a rank of this node ended': the first Ctrl-C killed
    torchrun and its ranks at once, with no chance to stop them."""
    from draftforge.splitserve import launch
    from draftforge.splitserve.supervisor import JobInterrupted

    pid_file = tmp_path / "rank.pid"
    seen = threading.Event()
    real_started = launch._started

    def started(pid: int):
        found = real_started(pid)
        if found is not None and pid_file.exists() and pid_file.read_text() == str(pid):
            seen.set()  # the launcher has looked at the running rank
        return found

    monkeypatch.setattr(launch, "_started", started)

    def signal_once_seen() -> None:
        if seen.wait(60):
            os.kill(os.getpid(), signal.SIGTERM)

    script = tmp_path / "torchrun.py"
    script.write_text(_STARTING_TORCHRUN)
    threading.Thread(target=signal_once_seen, daemon=True).start()
    with pytest.raises(JobInterrupted) as stop:
        launch.run_torchrun([sys.executable, str(script), str(pid_file)], env=os.environ, nproc=2,
                            hint="rerun")
    rank = int(pid_file.read_text())
    try:
        assert stop.value.code == 128 + signal.SIGTERM
        assert Path(str(pid_file) + ".stopping").exists()  # torchrun got the signal and stopped its rank
        err = capsys.readouterr().err
        assert "stopped on SIGTERM; rerun" in err and "after a rank of this node ended" not in err, err
        deadline = time.monotonic() + 10
        while _alive(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(rank)
    finally:
        if _alive(rank):
            os.kill(rank, signal.SIGKILL)


# torchrun after one of its two ranks failed: it waits for the other (torchrun's own grace)
_TORCHRUN_LOST_A_RANK = """
import os, signal, subprocess, sys, time
def stopping(signum, frame):
    open(sys.argv[1] + ".stopping", "w").close()
signal.signal(signal.SIGTERM, stopping)
signal.signal(signal.SIGINT, stopping)
code = "import os, sys, time\\nopen(sys.argv[1], 'w').write(str(os.getpid()))\\n"
alive = subprocess.Popen([sys.executable, "-c", code + "time.sleep(120)", sys.argv[1] + ".alive"],
                         start_new_session=True)
failing = subprocess.Popen([sys.executable, "-c", code + "while not os.path.exists(sys.argv[2]):\\n"
                            "    time.sleep(0.02)\\nsys.exit(1)", sys.argv[1] + ".failing", sys.argv[1] + ".go"],
                           start_new_session=True)
failing.wait()
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_signal_after_a_rank_ended_kills_what_is_left_at_once(tmp_path, capsys, monkeypatch):
    from draftforge.splitserve import launch
    from draftforge.splitserve.supervisor import JobInterrupted

    base = tmp_path / "rank"
    alive_file, failing_file = Path(f"{base}.alive"), Path(f"{base}.failing")
    real_started = launch._started
    seen: set[int] = set()

    def started(pid: int):
        found = real_started(pid)
        if found is not None:
            seen.add(pid)
            pids = {int(f.read_text()) for f in (alive_file, failing_file) if f.exists() and f.read_text()}
            if len(pids) == 2 and pids <= seen:
                Path(f"{base}.go").touch()  # both seen: the failing rank may fail now
        return found

    monkeypatch.setattr(launch, "_started", started)

    def signal_once_failed() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if failing_file.exists() and failing_file.read_text() and not _alive(int(failing_file.read_text())):
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    script = tmp_path / "torchrun.py"
    script.write_text(_TORCHRUN_LOST_A_RANK)
    threading.Thread(target=signal_once_failed, daemon=True).start()
    with pytest.raises(JobInterrupted):
        launch.run_torchrun([sys.executable, str(script), str(base)], env=os.environ, nproc=2, hint="rerun")
    rank = int(alive_file.read_text())
    try:
        err = capsys.readouterr().err
        assert "after a rank of this node ended (killed what was left)" in err, err
        assert not Path(f"{base}.stopping").exists()  # not passed on: killed at once
        deadline = time.monotonic() + 10
        while _alive(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(rank)
    finally:
        if _alive(rank):
            os.kill(rank, signal.SIGKILL)


@pytest.mark.parametrize("backend, term_s", [("hf", 5.0), ("sglang", 45.0)])
def test_an_sglang_target_gets_time_to_close_its_runner_before_sigkill(tmp_path, monkeypatch, backend, term_s):
    """The launcher SIGKILLed ranks 5 s after SIGTERM; an SGLang target rank closing its
    feature runner waits up to 30 s for its children's batch and 10 s after their SIGTERM."""
    from splitserve_helpers import tiny_recipe

    from draftforge.splitserve import launch

    asked: list[float] = []

    def job(*args, term_s, **kwargs):
        asked.append(term_s)
        return 0

    monkeypatch.setattr(launch, "run_ranks", job)
    monkeypatch.setattr(launch, "preflight", lambda cfg: None)  # the target is not loaded here
    recipe = tiny_recipe(tmp_path)
    assert launch.main([str(recipe), f"target.backend={backend}"]) == 0
    assert asked == [term_s]


@pytest.mark.parametrize("node, refused", [(0, False), (1, True)])
def test_the_launcher_checks_the_ranks_of_its_own_node(tmp_path, monkeypatch, node, refused):
    """A two-node gloo split on machines without GPUs, train.device cuda: node 0 runs the
    target rank alone (on the CPU) and starts; node 1 runs the trainer and is refused."""
    from splitserve_helpers import tiny_recipe

    from draftforge.config import RecipeError
    from draftforge.splitserve import launch

    started = []
    monkeypatch.setattr(launch, "run_torchrun", lambda *a, **k: started.append(a) or 0)
    monkeypatch.setattr(launch, "check_master_port", lambda port: None)
    monkeypatch.setattr(launch, "preflight", lambda cfg: None)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    recipe = tiny_recipe(tmp_path, overrides={"split.num_nodes": 2, "split.comm_backend": "gloo",
                                              "train.device": "cuda"})
    args = [str(recipe), "--node-rank", str(node), "--master-addr", "10.0.0.5"]
    if refused:
        with pytest.raises(RecipeError, match="train.device: cuda, but no CUDA GPU is visible"):
            launch.main(args)
        assert not started
    else:
        assert launch.main(args) == 0
        assert len(started) == 1
