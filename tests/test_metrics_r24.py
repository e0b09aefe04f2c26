"""Review round 24 of the run's records: metrics.jsonl durable before each checkpoint, and the
folder each segment ran in."""

from __future__ import annotations

import json
import os
import sys

from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.train.metrics import write_run_records
from draftforge.train.sample import pack
from draftforge.train.trainer import Trainer


def test_metrics_are_on_disk_before_each_checkpoint(tmp_path, monkeypatch):
    """A checkpoint is fsynced; metrics.jsonl was only flushed. A machine crash after a
    checkpoint could lose the records of the steps it holds, which a resume never redoes:
    a gap in metrics.jsonl for good. Each checkpoint now finds every record so far fsynced."""
    metrics = str(tmp_path.resolve() / "metrics.jsonl")
    synced: dict[str, int] = {}  # path -> size at its last fsync
    real_fsync = os.fsync

    def fsync(fd):
        synced[os.readlink(f"/proc/self/fd/{fd}")] = os.fstat(fd).st_size
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    seen = []
    real_save = Trainer.save

    def save(self, **kwargs):
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        seen.append((self.step, [json.loads(line)["step"] for line in lines], synced.get(metrics)))
        return real_save(self, **kwargs)

    monkeypatch.setattr(Trainer, "save", save)
    trainer = Trainer(model_config=tiny_model_config(), train=train_config(steps=5, checkpoint_interval=2),
                      embeddings=target_embeddings(), run_dir=tmp_path, recipe_yaml="name: test\n")
    trainer.fit(pack(chain_samples(20), 90))
    size = [len("".join(line + "\n" for line in (tmp_path / "metrics.jsonl").read_text().splitlines()[:n]))
            for n in (2, 4, 5)]
    assert seen == [(2, [1, 2], size[0]), (4, [1, 2, 3, 4], size[1]), (5, [1, 2, 3, 4, 5], size[2])]


def test_each_segment_records_the_folder_its_relative_paths_are_in(tmp_path, monkeypatch):
    """A rank's command names the recipe as typed (``recipes/r.yaml``), relative to a folder
    run.json did not record: the command could not be rerun, nor the recipe file found."""
    for where in ("a", "b"):
        (tmp_path / where).mkdir()
        monkeypatch.chdir(tmp_path / where)
        monkeypatch.setattr(sys, "argv", ["/x/train/__main__.py", "recipes/r.yaml"])
        write_run_records(tmp_path / "run", recipe_yaml="a: 1\n", details={})
    segments = json.loads((tmp_path / "run" / "run.json").read_text())["segments"]
    assert [(s["command"][1:], s["cwd"]) for s in segments] == [
        (["/x/train/__main__.py", "recipes/r.yaml"], str(tmp_path.resolve() / "a")),
        (["/x/train/__main__.py", "recipes/r.yaml"], str(tmp_path.resolve() / "b"))]
