"""``draftforge bench split`` keeps both sides alive through its phases: a phase longer than
``split.peer_timeout_s`` is not silence, and a benchmark's failure gives no resume advice."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from draftforge.splitserve.roles import _say_how_to_resume

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-debug.yaml"
TIMEOUT_S = 1.5


@pytest.mark.distributed
@pytest.mark.integration
def test_phases_longer_than_the_peer_timeout_are_not_silence(tmp_path):
    """Phase 1 ran with the target's heartbeat closed and phase 2 with no trainer heartbeat:
    the trainer died waiting for phase 1's rate (named 'the target's embeddings'), or the
    target waiting for phase 3, once a phase outlasted split.peer_timeout_s."""
    result = subprocess.run(
        [sys.executable, "-m", "draftforge", "bench", "split", str(TINY), "--steps", "3",
         "data.num_samples=64", "target.generation.batch_size=8",
         f"split.peer_timeout_s={TIMEOUT_S}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1].startswith("split_efficiency="), result.stdout
    # both phases outlasted the timeout (else this run proves nothing)
    phase_1 = re.search(r"\[rank 0 target\]\s+\d+ tokens in ([0-9.]+) s", result.stderr)
    phase_2 = re.search(r"\[rank 1 trainer\]\s+\d+ tokens in ([0-9.]+) s", result.stderr)
    assert phase_1 and phase_2, result.stderr[-3000:]
    assert float(phase_1.group(1)) > TIMEOUT_S and float(phase_2.group(1)) > TIMEOUT_S, result.stderr


def _ctx(resume: str):
    lines = []
    cfg = SimpleNamespace(train=SimpleNamespace(resume=resume, output_dir="/runs/x"))
    return SimpleNamespace(cfg=cfg, log=lines.append), lines


@pytest.mark.parametrize(("resume", "bench", "advised"), [
    ("auto", None, True),
    ("never", None, False),  # a rerun starts over
    ("never", {"steps": 2}, False),  # the benchmark: its scratch run is gone
    ("auto", {"steps": 2}, False),
])
def test_resume_advice_only_where_a_rerun_resumes(resume, bench, advised):
    ctx, lines = _ctx(resume)
    _say_how_to_resume(ctx, bench)
    assert lines == ([f"the run can be resumed: rerun the same command (train.resume={resume}) "
                      "to continue from the newest checkpoint in /runs/x"] if advised else [])


def test_the_launcher_offers_no_resume_to_a_run_that_never_resumes(tmp_path, capsys, monkeypatch):
    """With train.resume=never the launcher said 'Rerun the same command to resume from the
    newest checkpoint ... (train.resume=never)': that rerun starts over, or is refused."""
    from splitserve_helpers import tiny_recipe

    from draftforge.splitserve.launch import main as train_main

    recipe = tiny_recipe(tmp_path)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "COMPLETE").write_text("")
    (checkpoint / "trainer_state.json").write_text("{}")
    monkeypatch.setattr("draftforge.splitserve.launch.run_ranks", lambda *a, **k: 1)
    monkeypatch.setattr("draftforge.splitserve.launch.preflight", lambda cfg: None)
    assert train_main([str(recipe), "train.resume=never"]) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == (
        "draftforge train: the job failed (exit status 1); the messages above name the failing "
        f"rank. With train.resume=never the same command starts over (refused once {tmp_path / 'run'} "
        "holds a checkpoint); rerun with train.resume=auto to continue from the newest checkpoint "
        "instead.")
