"""Review round 32: checkpoints, exact resume and what a run leaves behind (metrics, summary)."""

from __future__ import annotations

import json
import sys
import types

from trainer_helpers import train_config

from draftforge.train.metrics import METRICS_FILE, MetricsLog


def _fake_tensorboard(monkeypatch) -> list:
    """A SummaryWriter that records its purge_step and, like torch's, leaves an event file."""
    purges = []
    fake = types.ModuleType("torch.utils.tensorboard")

    class SummaryWriter:
        def __init__(self, log_dir, purge_step=None):
            purges.append(purge_step)
            from pathlib import Path

            Path(log_dir).mkdir(parents=True, exist_ok=True)
            (Path(log_dir) / f"events.out.tfevents.{len(purges)}.host.1.0").write_bytes(b"x")

        def add_scalar(self, tag, value, step):
            pass

        def close(self):
            pass

    fake.SummaryWriter = SummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    return purges


def test_a_fresh_start_over_a_crashed_runs_events_purges_them_as_metrics_jsonl_drops_them(
        tmp_path, monkeypatch):
    """A run that crashed before its first checkpoint left steps 1-3 in metrics.jsonl and in
    TensorBoard; its rerun starts at step 0. metrics.jsonl drops the three records; TensorBoard
    used to keep their events (no purge_step), drawing both runs' steps 1.. as one series."""
    purges = _fake_tensorboard(monkeypatch)
    train = train_config(tensorboard=True)
    crashed = MetricsLog(tmp_path, train=train, recipe_yaml=None, resume_step=0)
    for step in (1, 2, 3):
        crashed.log({"step": step, "loss": 1.0})
    crashed.close()
    assert purges == [None]  # an empty folder: nothing to purge

    def logged():
        return [json.loads(line)["step"] for line in (tmp_path / METRICS_FILE).read_text().splitlines()]

    before = logged()
    assert before == [1, 2, 3]
    rerun = MetricsLog(tmp_path, train=train, recipe_yaml=None, resume_step=0)
    rerun.close()
    dropped = sorted(set(before) - set(logged()))
    assert dropped == [1, 2, 3]  # every crashed step is redone...
    assert purges[-1] == dropped[0]  # ...so TensorBoard drops its events from the first one on

    # a resume at step 2 still drops steps 3 on, as before
    again = MetricsLog(tmp_path, train=train, recipe_yaml=None, resume_step=2)
    again.close()
    assert purges[-1] == 3
