"""Checkpoint edge cases: optimizer settings on resume, the save at the end of the data,
a crash while pruning, and failures on one rank of several (which must name the rank and
never hang)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from test_trainer_distributed import launch
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.train import checkpoint as ckpt
from draftforge.train import trainer as trainer_module
from draftforge.train.sample import pack
from draftforge.train.trainer import Trainer


def _trainer(run_dir: Path, **train) -> Trainer:
    return Trainer(model_config=tiny_model_config(), train=train_config(output_dir=str(run_dir), **train),
                   embeddings=target_embeddings(), run_dir=run_dir, recipe_yaml="x: 1\n")


def test_resume_uses_this_recipes_weight_decay_betas_and_eps(tmp_path, capsys):
    run = tmp_path / "run"
    first = dict(steps=2, weight_decay=0.0, adam_beta2=0.999, adam_eps=1e-8)
    _trainer(run, **first).fit(pack(chain_samples(20), 90))
    capsys.readouterr()
    again = _trainer(run, **dict(first, steps=4, resume="auto"))
    assert again.resume().optimizer_change == ""  # same settings: nothing to say
    assert "AdamW" not in capsys.readouterr().out

    changed = _trainer(run, steps=4, weight_decay=0.1, adam_beta2=0.95, adam_eps=1e-6, resume="auto")
    info = changed.resume()
    for group in changed.optimizer.param_groups:
        assert group["weight_decay"] == 0.1
        assert tuple(group["betas"]) == (0.9, 0.95)
        assert group["eps"] == 1e-6
    assert "weight_decay 0.0 -> 0.1" in info.optimizer_change
    assert "betas (0.9, 0.999) -> (0.9, 0.95)" in info.optimizer_change
    assert "eps 1e-08 -> 1e-06" in info.optimizer_change
    assert f"note: {info.optimizer_change}" in capsys.readouterr().out


def test_data_running_out_right_after_an_interval_checkpoint_saves_it_once(tmp_path, monkeypatch):
    saves = []
    original = ckpt.save_checkpoint

    def spy(**kwargs):
        saves.append(kwargs["step"])
        return original(**kwargs)

    monkeypatch.setattr(trainer_module.ckpt, "save_checkpoint", spy)
    batches = pack(chain_samples(40), 90)[:4]
    result = _trainer(tmp_path / "run", steps=10, checkpoint_interval=2).fit(batches)
    assert result.stopped_reason == "data_exhausted" and result.step == 4
    assert saves == [2, 4]
    assert result.checkpoint == ckpt.checkpoint_path(tmp_path / "run", 4)


class Crash(BaseException):
    """The process dies (no exception handler runs)."""


def test_a_crash_while_pruning_leaves_no_complete_looking_folder_without_its_files(tmp_path, monkeypatch):
    run = tmp_path / "run"
    trainer = _trainer(run, steps=6, checkpoint_interval=2, keep_last=1)
    batches = pack(chain_samples(40), 90)
    real_rmtree = shutil.rmtree
    doomed = ckpt.checkpoint_path(run, 2).name

    def dies_midway(path, *args, **kwargs):
        path = Path(path)
        if path.name.startswith((doomed, f".{doomed}")) and not path.name.endswith(".tmp"):
            (path / "model.safetensors").unlink()  # part of the folder is gone, then the crash
            raise Crash
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(ckpt.shutil, "rmtree", dies_midway)
    with pytest.raises(Crash):
        trainer.fit(batches)  # saving step 4 prunes step 2
    monkeypatch.setattr(ckpt.shutil, "rmtree", real_rmtree)
    assert ckpt.complete_checkpoints(run) == [ckpt.checkpoint_path(run, 4)]
    for path in ckpt.complete_checkpoints(run):
        assert (path / "model.safetensors").is_file()
    assert ckpt.find_resume(run, "auto") == ckpt.checkpoint_path(run, 4)
    # Leftovers of crashes (the half-deleted folder, a save's .tmp, a stale moved-aside copy of
    # a step that is in place again) go at the next prune; a moved-aside copy that is the only
    # one of a kept step stays.
    root = ckpt.checkpoints_root(run)
    (root / "step_00000003.tmp").mkdir()
    (root / ".step_00000004.old-abc" / "step_00000004").mkdir(parents=True)
    (root / ".step_00000009.old-abc" / "step_00000009").mkdir(parents=True)
    assert [p.name for p in root.iterdir() if ".trash-" in p.name]
    resumed = _trainer(run, steps=6, checkpoint_interval=2, keep_last=1, resume="auto")
    resumed.resume()
    resumed.fit(batches[4:])
    assert sorted(p.name for p in root.iterdir()) == [".step_00000009.old-abc", "step_00000006"]


# -- several trainer ranks ----------------------------------------------------------------


def _errors(tmp_path: Path, name: str, world: int) -> list[dict]:
    return [json.loads((tmp_path / f"{name}.json.rank{rank}.error").read_text()) for rank in range(world)]


@pytest.mark.distributed
@pytest.mark.parametrize("where", ["rng", "dcp"])
def test_a_failed_save_on_one_rank_names_that_rank_and_its_error_on_every_rank(tmp_path, where):
    # rng: a file of trainer rank 1's own; dcp: its shard, where torch's DCP raises a
    # BaseException on every rank
    train = dict(strategy="fsdp2", dtype="float32", steps=4, checkpoint_interval=2)
    with pytest.raises(AssertionError):
        launch(tmp_path, "fail", world=2, trainer_ranks=[0, 1], train=train, fail_save_rank=1,
               fail_in=where, pg_timeout_s=30, timeout=120)
    for error in _errors(tmp_path, "fail", 2):
        assert error["type"] == "CheckpointError" and error["step"] == 2
        assert "writing the checkpoint of step 2" in error["message"]
        assert "(trainer rank 1: OSError: [Errno 28] No space left on device" in error["message"]
        assert "trainer rank 0" not in error["message"]
    assert not list((tmp_path / "fail" / "checkpoints").iterdir())


@pytest.mark.distributed
def test_a_trainer_group_without_shared_output_dir_is_refused_before_step_one(tmp_path):
    train = dict(strategy="fsdp2", dtype="float32", steps=4, checkpoint_interval=2, output_dir="run")
    with pytest.raises(AssertionError):
        launch(tmp_path, "split", world=2, trainer_ranks=[0, 1], train=train, rank_dirs=True,
               pg_timeout_s=30, timeout=120)
    rank0_marker = tmp_path / "split" / "node0" / "run"
    for error in _errors(tmp_path, "split", 2):
        assert error["type"] == "InputError" and error["step"] == 0
        assert error["message"].startswith(
            "train.output_dir run must be on storage shared by all trainer ranks (trainer rank 1 "
            f"does not see {tmp_path / 'split' / 'node1' / 'run' / '.shared-check-'}")
        assert f"which trainer rank 0 wrote as {rank0_marker / '.shared-check-'}" in error["message"]
        assert "trainer rank 0 does not see" not in error["message"]
    assert list(rank0_marker.iterdir()) == []  # no marker left, no records, no step run


@pytest.mark.distributed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed==0.19.8)")
def test_deepspeed_save_failing_on_one_rank_raises_on_every_rank_without_hanging(tmp_path):
    # DeepSpeed's save ends in a barrier; the failing rank used to skip it and both ranks waited
    # for the process-group timeout (30 s here) and died of it.
    train = dict(strategy="deepspeed", zero_stage=2, dtype="float32", steps=2, checkpoint_interval=100)
    with pytest.raises(AssertionError):
        launch(tmp_path, "ds", world=2, trainer_ranks=[0, 1], train=train, fail_save_rank=1,
               pg_timeout_s=30, timeout=240)
    for error in _errors(tmp_path, "ds", 2):
        assert error["type"] == "CheckpointError", error
        assert "writing the checkpoint of step 2" in error["message"]
        assert "trainer rank 1: OSError: [Errno 28] No space left on device" in error["message"]
    assert not list((tmp_path / "ds" / "checkpoints").iterdir())  # no .tmp left
