"""Checkpoint review, round 25: two runs into one output folder, and a checkpoint file this user
cannot read.

In one process (train.strategy single), besides one child process holding a run folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.train import checkpoint as ckpt
from draftforge.train.sample import pack
from draftforge.train.trainer import Trainer


def _trainer(run_dir: Path, **overrides) -> Trainer:
    return Trainer(model_config=tiny_model_config(num_hidden_layers=1),
                   train=train_config(str(run_dir), **overrides), embeddings=target_embeddings(),
                   run_dir=run_dir, recipe_yaml="name: r25\n")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A run directory with a complete checkpoint at step 2 (copied by each test)."""
    run = tmp_path_factory.mktemp("saved") / "run"
    _trainer(run, steps=2, checkpoint_interval=2).fit(pack(chain_samples(12), 90))
    return run


@pytest.fixture()
def run(saved_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(saved_run, copy)
    return copy


# -- 1. a second run into the same train.output_dir -----------------------------------------

_RESUME_AND_WAIT = """
import sys
import tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from trainer_helpers import target_embeddings, tiny_model_config, train_config
from draftforge.train.trainer import Trainer
run = Path(sys.argv[1])
trainer = Trainer(model_config=tiny_model_config(num_hidden_layers=1),
                  train=train_config(str(run), resume="auto"), embeddings=target_embeddings(),
                  run_dir=run, recipe_yaml="name: r25\\n")
print(trainer.resume().step, flush=True)
sys.stdin.read()  # trains on until the test closes its stdin
"""


def test_a_second_run_into_an_output_dir_a_running_trainer_uses_is_refused(run):
    first = subprocess.Popen([sys.executable, "-c", _RESUME_AND_WAIT, str(run), str(Path(__file__).parent)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "2"  # the first run resumed from step 2
        second = _trainer(run, steps=4, checkpoint_interval=2, resume="auto")
        with pytest.raises(ckpt.CheckpointError) as info:
            second.resume()
        message = str(info.value)
        assert message.startswith(f"train.output_dir {run} is in use by another training run (process "
                                  f"{first.pid} holds {run.absolute() / ckpt.RUN_LOCK})")
        assert message.endswith("Wait for it to end (or stop it), or use another train.output_dir")
        with pytest.raises(ckpt.CheckpointError, match="in use by another training run"):
            second.fit(pack(chain_samples(24), 90))  # fit without resume is refused alike
        assert second.step == 0 and ckpt.complete_checkpoints(run) == [run / "checkpoints" / "step_00000002"]
    finally:
        first.stdin.close()
        first.wait(timeout=60)
    # once the first run has ended (however it ended), the folder is free again
    info = _trainer(run, steps=4, checkpoint_interval=2, resume="auto").resume()
    assert info is not None and info.step == 2


# -- 2. the files of a checkpoint get the mode open() would give them ------------------------


def test_every_checkpoint_file_is_as_readable_as_the_umask_lets_open_make_it(tmp_path):
    old = os.umask(0o002)  # a group sharing its runs
    try:
        _trainer(tmp_path / "run", steps=2, checkpoint_interval=2).fit(pack(chain_samples(12), 90))
    finally:
        os.umask(old)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    modes = {str(p.relative_to(checkpoint)): p.stat().st_mode & 0o777 for p in checkpoint.rglob("*")}
    assert modes == {"COMPLETE": 0o664, "draft_config.json": 0o664, "trainer_state.json": 0o664,
                     "model.safetensors": 0o664, "optimizer.safetensors": 0o664, "optimizer.json": 0o664,
                     "recipe.yaml": 0o664, "rng": 0o775, "rng/rank_0.safetensors": 0o664}


# -- 3. a checkpoint file this user may not read is not called corrupt or missing -------------


@contextlib.contextmanager
def _as_another_user():
    """This user may read what its file modes allow (root reads everything: drop to nobody)."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


@pytest.mark.parametrize("name", ["trainer_state.json", "model.safetensors", "rng/rank_0.safetensors"])
def test_a_checkpoint_file_this_user_may_not_read_is_named_and_not_to_be_deleted(saved_run, name):
    shared = Path(tempfile.mkdtemp(prefix="r25-", dir="/tmp"))  # a folder everyone may enter
    try:
        shared.chmod(0o755)
        run = shared / "run"
        shutil.copytree(saved_run, run)
        for item in [run, *run.rglob("*")]:
            item.chmod(0o755 if item.is_dir() else 0o644)
        run.chmod(0o777)  # the run folder (its lock) is the other user's to write; the files are not
        checkpoint = run / "checkpoints" / "step_00000002"
        (checkpoint / name).chmod(0o600)  # written by another user, privately
        trainer = _trainer(run, steps=4, resume="auto")
        with _as_another_user(), pytest.raises(ckpt.CheckpointError) as info:
            trainer.resume()
        assert str(info.value) == (
            f"checkpoint {checkpoint}: this user cannot read {checkpoint / name} (Permission denied); "
            "do not delete the checkpoint for that, it may be whole: have its owner make it readable "
            f"to this user (e.g. chmod -R a+rX {checkpoint}), or run as that user")
        with _as_another_user(), pytest.raises(ckpt.CheckpointError, match="this user cannot read"):
            ckpt.find_resume(run, str(checkpoint))  # a train.resume path alike
        assert trainer.step == 0
    finally:
        shutil.rmtree(shared)


# -- 4. a checkpoint without its draft config is not resumed under any draft shape --------------


def test_a_checkpoint_without_its_draft_config_is_incomplete_not_resumed_under_another_draft(run):
    checkpoint = run / "checkpoints" / "step_00000002"
    (checkpoint / ckpt.DRAFT_CONFIG_FILE).unlink()
    other = Trainer(model_config=tiny_model_config(num_hidden_layers=1, block_size=8),  # the run's is 4
                    train=train_config(str(run), steps=4, resume="auto"), embeddings=target_embeddings(),
                    run_dir=run, recipe_yaml="name: r25\n")
    with pytest.raises(ckpt.CheckpointError) as info:
        other.resume()
    assert str(info.value) == (
        f"checkpoint {checkpoint} has no draft_config.json; it is incomplete: delete it and rerun: the "
        "run starts over, as no earlier complete checkpoint exists")
    assert other.step == 0
