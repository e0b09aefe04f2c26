"""A live peer that is busy longer than ``split.peer_timeout_s`` is not reported dead.

Each run is a whole 2-process SplitServe job (gloo, CPU, tiny random target) with a
short peer timeout; one rank is made busy for several timeouts by a patch applied in
its own process before the rank starts (a slow step or checkpoint save on the trainer,
a slow answer generation on the target, a slow start on either). Real deaths stay detected: see the hung-trainer
test here and the dead / silent target tests of ``test_splitserve_runs.py``.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from splitserve_helpers import (
    PYTHON,
    ROOT,
    free_port,
    metrics,
    rank_env,
    read_logs,
    tiny_recipe,
    wait_all,
)

pytestmark = pytest.mark.distributed

TIMEOUT_S = 4  # split.peer_timeout_s of these runs
BUSY_S = 10  # how long the busy rank works in one go: two and a half timeouts

LAUNCH = """\
import sys
import time
{patch}
from draftforge.train.__main__ import exit_now, main
exit_now(main([sys.argv[1]]))
"""

# the trainer's checkpoint save of step STEP takes BUSY seconds (a big model's save)
SLOW_SAVE = """
from draftforge.train.trainer import Trainer
_save = Trainer.save
def _slow_save(self, **kwargs):
    if self.step == {step}:
        print("[test] saving slowly", file=sys.stderr, flush=True)
        time.sleep({busy})
    return _save(self, **kwargs)
Trainer.save = _slow_save
"""

# the trainer's optimizer step STEP takes BUSY seconds (a first torch.compile)
SLOW_STEP = """
from draftforge.train.trainer import Trainer
_step = Trainer.train_step
def _slow_step(self, *args, **kwargs):
    if self.step + 1 == {step}:
        print("[test] stepping slowly", file=sys.stderr, flush=True)
        time.sleep({busy})
    return _step(self, *args, **kwargs)
Trainer.train_step = _slow_step
"""

# the target's answers to chunk CALL (1-based) take BUSY seconds (long generations)
SLOW_GENERATION = """
import draftforge.data.regenerate as regenerate
_answer = regenerate.answer_batch
_calls = []
def _slow_answer(*args, **kwargs):
    _calls.append(1)
    if len(_calls) == {call}:
        print("[test] generating slowly", file=sys.stderr, flush=True)
        time.sleep({busy})
    return _answer(*args, **kwargs)
regenerate.answer_batch = _slow_answer
"""


# the target takes BUSY seconds more to load (a big model)
SLOW_LOAD = """
import draftforge.splitserve.roles as roles
_build = roles.build_engine
def _slow_build(ctx):
    print("[test] loading slowly", file=sys.stderr, flush=True)
    time.sleep({busy})
    return _build(ctx)
roles.build_engine = _slow_build
"""

# the trainer takes BUSY seconds more to resume (a big checkpoint, a first compile)
SLOW_RESUME = """
from draftforge.train.trainer import Trainer
_resume = Trainer.resume
def _slow_resume(self, *args, **kwargs):
    print("[test] resuming slowly", file=sys.stderr, flush=True)
    time.sleep({busy})
    return _resume(self, *args, **kwargs)
Trainer.resume = _slow_resume
"""


def _recipe(tmp: Path, **overrides) -> Path:
    return tiny_recipe(tmp, steps=overrides.pop("steps", 8), overrides={
        "split.peer_timeout_s": TIMEOUT_S, "train.checkpoint_interval": 4, **overrides})


def _spawn(recipe: Path, patches: dict[int, str], log_dir: Path, world: int = 2) -> list[subprocess.Popen]:
    """Every rank of ``recipe`` as ``python -m draftforge.train`` would run it, each after
    its patch (rank -> code)."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world):
        code = LAUNCH.format(patch=patches.get(rank, ""))
        out = open(log_dir / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([PYTHON, "-c", code, str(recipe)],
                                      env=rank_env(rank, world, port), stdout=out,
                                      stderr=subprocess.STDOUT, cwd=ROOT))
    return procs


def _run(tmp: Path, recipe: Path, patches: dict[int, str], timeout: float = 150, world: int = 2) -> list[str]:
    log_dir = tmp / "logs"
    codes = wait_all(_spawn(recipe, patches, log_dir, world), timeout)
    logs = read_logs(log_dir, world)
    assert codes == [0] * world, "\n\n".join(log[-3000:] for log in logs)
    return logs


def _steps(run_dir: Path) -> list[int]:
    return sorted({r["step"] for r in metrics(run_dir) if "step" in r and "loss" in r})


@pytest.mark.parametrize("slow", ["save", "step"])
def test_trainer_busy_longer_than_the_timeout_is_not_dead(tmp_path, slow):
    """(a) One checkpoint save or one step of several timeouts: the target waits for credits
    meanwhile (the trainer holds every sample it may have) and must not call it dead."""
    recipe = _recipe(tmp_path)
    patch = (SLOW_SAVE if slow == "save" else SLOW_STEP).format(step=4, busy=BUSY_S)
    logs = _run(tmp_path, recipe, {1: patch})
    assert f"[test] {'saving' if slow == 'save' else 'stepping'} slowly" in logs[1]
    assert _steps(tmp_path / "run") == list(range(1, 9))


def test_target_busy_generating_longer_than_the_timeout_is_not_dead(tmp_path):
    """(b) One chunk of answers of several timeouts (long generations on a slow target):
    the trainer waits for its samples meanwhile and must not call the target dead."""
    recipe = _recipe(tmp_path, steps=6, **{"data.regenerate": True, "data.min_loss_tokens": 2})
    logs = _run(tmp_path, recipe, {0: SLOW_GENERATION.format(call=3, busy=BUSY_S)})
    assert "[test] generating slowly" in logs[0]
    assert _steps(tmp_path / "run") == list(range(1, 7))


def test_final_save_longer_than_the_timeout_ends_cleanly(tmp_path):
    """(c) The final checkpoint takes several timeouts while the target waits for the
    trainer's stop: both ranks end with status 0."""
    recipe = _recipe(tmp_path)
    logs = _run(tmp_path, recipe, {1: SLOW_SAVE.format(step=8, busy=BUSY_S)})
    assert "[test] saving slowly" in logs[1]
    assert (tmp_path / "run" / "checkpoints" / "step_00000008").is_dir()
    assert "note: teardown" not in logs[0] + logs[1]


def test_target_busy_when_the_trainer_stops_ends_cleanly(tmp_path):
    """(c) The trainer has its steps while the target still generates a chunk of several
    timeouts: the trainer waits for the end of the stream and both ranks end with status 0."""
    recipe = _recipe(tmp_path, steps=1, **{"data.regenerate": True, "data.min_loss_tokens": 2,
                                           "target.generation.batch_size": 8})
    logs = _run(tmp_path, recipe, {0: SLOW_GENERATION.format(call=2, busy=BUSY_S)})
    assert "[test] generating slowly" in logs[0]
    assert "finished at step 1" in logs[1]
    assert "note: teardown" not in logs[0] + logs[1]


def test_slow_start_on_either_side_is_not_dead(tmp_path):
    """Startup: the trainer waits for its embeddings while the target loads, then the
    target waits for the trainer's resume state while it builds and resumes its draft."""
    recipe = _recipe(tmp_path, steps=4)
    logs = _run(tmp_path, recipe, {0: SLOW_LOAD.format(busy=BUSY_S),
                                   1: SLOW_RESUME.format(busy=BUSY_S)})
    assert "[test] loading slowly" in logs[0] and "[test] resuming slowly" in logs[1]
    assert _steps(tmp_path / "run") == [1, 2, 3, 4]


def test_hung_trainer_is_still_reported_by_the_target(tmp_path):
    """A trainer that hangs (SIGSTOP: no heartbeat either) is reported by the target after
    about split.peer_timeout_s, naming its rank, not waited on forever."""
    from draftforge.train.checkpoint import complete_checkpoints

    recipe = _recipe(tmp_path, steps=2000)  # it is stopped at its first checkpoint
    log_dir = tmp_path / "logs"
    procs = _spawn(recipe, {}, log_dir)
    try:
        deadline = time.monotonic() + 90
        # any checkpoint: step 4's folder alone is pruned within a second (the last 3 are kept)
        while not complete_checkpoints(tmp_path / "run"):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        assert wait_all(procs[:1], 60) == [3]
        assert time.monotonic() - stopped_at < 8 * TIMEOUT_S
        log = read_logs(log_dir, 2)[0]
        assert "trainer rank 1 sent nothing within the timeout" in log, log[-2000:]
    finally:
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()


def test_peer_died_tells_a_silent_peer_from_a_closed_one():
    """gloo's own messages, as ranks here met them: an op that waited out the timeout, a later
    op over the pair that timeout closed (a SIGSTOPped target, seen under load), and a peer
    process that exited."""
    from draftforge.splitserve.transport import PeerDied

    waited = "[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 6000ms for recv"
    closed_by_timeout = "Application timeout caused pair closure"
    exited = ("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:7069. "
              "This is typically caused by a remote worker crashing.")
    for cause in (waited, closed_by_timeout):
        text = str(PeerDied(0, "target", "returning credits", RuntimeError(cause)))
        assert text.startswith("target rank 0 sent nothing within the timeout "
                               "(split.peer_timeout_s)"), text
        assert text.endswith("(while returning credits)")
    text = str(PeerDied(0, "target", "receiving a sample", RuntimeError(exited)))
    assert text.startswith("target rank 0 died or closed its connection: [gloo"), text


def test_a_slow_resume_is_not_silence_to_a_second_target(tmp_path):
    """Two target ranks feed one trainer. Its resume takes three timeouts: the second target,
    which does not send it the embeddings, heard no heartbeat before the resume state and
    reported it dead; every target now listens from its start and every one gets the beats."""
    recipe = _recipe(tmp_path, steps=4, **{"split.target_ranks": [0, 1], "split.trainer_ranks": [2]})
    logs = _run(tmp_path, recipe, {2: SLOW_RESUME.format(busy=BUSY_S)}, world=3)
    assert "[test] resuming slowly" in logs[2]
    assert _steps(tmp_path / "run") == [1, 2, 3, 4]
