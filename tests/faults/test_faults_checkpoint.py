"""Checkpoints under faults: a full disk mid-write, corrupt or truncated files, a draft of another shape.

In one process (train.strategy single). Each test asserts the message a user sees.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.errors import InputError
from draftforge.train import checkpoint as ckpt
from draftforge.train.sample import pack
from draftforge.train.trainer import Trainer


def _trainer(run_dir, model_config=None, **overrides) -> Trainer:
    return Trainer(model_config=model_config or tiny_model_config(num_hidden_layers=1),
                   train=train_config(str(run_dir), **overrides), embeddings=target_embeddings(),
                   run_dir=run_dir, recipe_yaml="name: faults\n")


def _batches():
    return pack(chain_samples(48), 90)


def _full_disk_on(call: int, monkeypatch):
    """Make the ``call``-th safetensors write of checkpoint.py fail with ENOSPC."""
    real = ckpt.save_file
    calls = {"n": 0}

    def save_file(tensors, filename, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            # a partial file first, as a real full disk leaves one
            with open(filename, "wb") as handle:
                handle.write(b"\x00" * 7)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_file", save_file)


def test_full_disk_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, steps=8, checkpoint_interval=4, resume="auto")
    # step 4's checkpoint writes 3 safetensors files (rng, model, optimizer); the 5th call is
    # step 8's model.safetensors.
    _full_disk_on(5, monkeypatch)
    with pytest.raises(ckpt.CheckpointError) as info:
        trainer.fit(_batches())
    message = str(info.value)
    assert f"writing the checkpoint of step 8 into {tmp_path / 'checkpoints'} failed" in message
    assert "No space left on device" in message
    assert f"the previous checkpoint {tmp_path / 'checkpoints' / 'step_00000004'} is intact" in message
    assert "Free disk space" in message
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_00000004"], "no partial (.tmp) folder is left behind"
    assert ckpt.find_resume(tmp_path, "auto").name == "step_00000004"

    # resume picks step 4 and the continued run equals an uninterrupted one
    monkeypatch.undo()
    resumed = _trainer(tmp_path, steps=8, checkpoint_interval=4, resume="auto")
    info = resumed.resume()
    assert info.step == 4
    batches = _batches()
    consumed = set(info.consumed_ids)
    rest = [b for b in batches if not {s.sample_id for s in b} & consumed]
    after = resumed.fit(rest)
    reference = _trainer(tmp_path / "reference", steps=8, checkpoint_interval=4).fit(_batches())
    assert after.losses == reference.losses[4:]
    assert after.sample_ids == reference.sample_ids[4:]


def test_exception_while_committing_a_checkpoint_leaves_no_partial_folder(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, steps=8, checkpoint_interval=4)
    real = ckpt._write_json

    def write_json(path, data):
        if path.name == ckpt.STATE_FILE and data["step"] == 8:
            raise RuntimeError("simulated crash while writing trainer_state.json")
        return real(path, data)

    monkeypatch.setattr(ckpt, "_write_json", write_json)
    with pytest.raises(ckpt.CheckpointError, match="simulated crash while writing trainer_state.json"):
        trainer.fit(_batches())
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000004"]
    assert ckpt.is_complete(tmp_path / "checkpoints" / "step_00000004")


def test_failed_first_checkpoint_says_there_is_none_to_resume(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, steps=4, checkpoint_interval=100)
    _full_disk_on(1, monkeypatch)
    with pytest.raises(ckpt.CheckpointError, match="no earlier checkpoint exists"):
        trainer.fit(_batches())
    assert not any((tmp_path / "checkpoints").iterdir())


@pytest.fixture()
def saved_run(tmp_path):
    """A run directory with complete checkpoints at steps 4 and 8."""
    _trainer(tmp_path, steps=8, checkpoint_interval=4).fit(_batches())
    return tmp_path


def _resume(run_dir, resume="auto"):
    return _trainer(run_dir, resume=resume).resume()


def _truncate(path, keep: int = 40):
    data = path.read_bytes()
    path.write_bytes(data[:keep])


@pytest.mark.parametrize("file", ["model.safetensors", "optimizer.safetensors",
                                  "rng/rank_0.safetensors"])
def test_truncated_safetensors_in_a_checkpoint_is_named(saved_run, file):
    newest = saved_run / "checkpoints" / "step_00000008"
    _truncate(newest / file)
    with pytest.raises(ckpt.CheckpointError) as info:
        _resume(saved_run)
    message = str(info.value)
    assert f"checkpoint file {newest / file} is corrupt or truncated" in message
    assert f"delete the folder {newest}" in message and "previous complete checkpoint" in message
    # following the advice works: the previous checkpoint loads
    import shutil

    shutil.rmtree(newest)
    assert _resume(saved_run).step == 4


def test_garbage_trainer_state_is_named(saved_run):
    newest = saved_run / "checkpoints" / "step_00000008"
    (newest / ckpt.STATE_FILE).write_text('{"step": 8, "consumed_')
    with pytest.raises(ckpt.CheckpointError, match=r"trainer_state.json is corrupt or truncated \(JSONDecodeError"):
        _resume(saved_run)


def test_bit_flipped_safetensors_header_is_named(saved_run):
    path = saved_run / "checkpoints" / "step_00000008" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[10:20] = b"\xff" * 10  # inside the JSON header
    path.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="model.safetensors is corrupt or truncated"):
        _resume(saved_run)


def test_missing_model_file_is_named(saved_run):
    newest = saved_run / "checkpoints" / "step_00000008"
    (newest / "model.safetensors").unlink()
    with pytest.raises(ckpt.CheckpointError, match="has no model.safetensors; it is incomplete"):
        _resume(saved_run)


@pytest.mark.parametrize("change, expected", [
    ({"block_size": 8}, "block_size: checkpoint 4, this recipe 8"),
    ({"hidden_size": 48, "target_hidden_size": 48}, "hidden_size: checkpoint 32, this recipe 48"),
    ({"target_layer_ids": [1, 3, 4]}, "target_layer_ids: checkpoint [0, 2, 4], this recipe [1, 3, 4]"),
    ({"vocab_size": 80}, "vocab_size: checkpoint 64, this recipe 80"),
])
def test_resuming_with_a_draft_of_another_shape_is_refused_with_what_differs(saved_run, change, expected):
    other = tiny_model_config(num_hidden_layers=1, **change)
    embeddings = target_embeddings()
    if "vocab_size" in change or "hidden_size" in change:
        vocab, hidden = other.vocab_size, other.target_hidden_size
        embeddings = (torch.randn(vocab, hidden), torch.randn(vocab, hidden))
    trainer = Trainer(model_config=other, train=train_config(str(saved_run), resume="auto"),
                      embeddings=embeddings, run_dir=saved_run)
    with pytest.raises(ckpt.CheckpointError) as info:
        trainer.resume()
    message = str(info.value)
    assert "was written for a different draft" in message and expected in message
    assert "Resume with the recipe that run used" in message


def test_checkpoints_record_the_draft_config(saved_run):
    saved = json.loads((saved_run / "checkpoints" / "step_00000008" / ckpt.DRAFT_CONFIG_FILE).read_text())
    assert saved == tiny_model_config(num_hidden_layers=1).to_dict()


def _resave_step_8(run_dir):
    """Resume from step 8 and save it again, over the existing folder."""
    trainer = _trainer(run_dir, steps=8, checkpoint_interval=4, resume="auto")
    assert trainer.resume().step == 8
    return trainer.save()


def test_resaving_a_step_keeps_the_old_checkpoint_until_the_new_one_is_in_place(saved_run, monkeypatch):
    """A save over a step that exists moves the old folder aside, not deleted, before the new
    one is renamed in; when that rename fails it comes back whole."""
    root = saved_run / "checkpoints"
    step8 = root / "step_00000008"
    before = {p.relative_to(step8): p.read_bytes() for p in step8.rglob("*") if p.is_file()}
    real_replace = os.replace

    def failing_replace(src, dst):
        if str(src).endswith("step_00000008.tmp"):
            raise OSError(errno.EIO, "simulated failure renaming the new checkpoint in")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(ckpt.CheckpointError, match="simulated failure renaming"):
        _resave_step_8(saved_run)
    monkeypatch.undo()
    after = {p.relative_to(step8): p.read_bytes() for p in step8.rglob("*") if p.is_file()}
    assert after == before
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000008"]

    # the same re-save without the failure writes the same step 8 again
    _resave_step_8(saved_run)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000008"]
    resaved = {p.relative_to(step8): p for p in step8.rglob("*") if p.is_file()}
    assert set(resaved) == set(before)
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert resaved[Path(name)].read_bytes() == before[Path(name)]


def test_resume_path_that_does_not_exist_or_is_incomplete(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="checkpoint folder .*nowhere does not exist"):
        _resume(tmp_path, resume=str(tmp_path / "nowhere"))
    (tmp_path / "half").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="is not a complete checkpoint"):
        _resume(tmp_path, resume=str(tmp_path / "half"))


def test_checkpoint_errors_are_input_errors():
    """The draftforge command prints them without a traceback and exits 2 (see test_faults_cli.py)."""
    assert issubclass(ckpt.CheckpointError, InputError)


def test_a_run_that_would_save_below_existing_checkpoints_is_refused(tmp_path):
    """A fresh run, or one resumed from an earlier checkpoint, in an output_dir holding later
    checkpoints: its own would rank below them (resume: auto and export pick the newest step,
    and pruning to keep_last would delete its own), so it stops before training, naming them."""
    _trainer(tmp_path, steps=8, checkpoint_interval=4, keep_last=5, resume="auto").fit(_batches())
    root = tmp_path / "checkpoints"
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step_00000004", "step_00000008"]
    with pytest.raises(ckpt.CheckpointError, match=(
            r"already holds checkpoints \(step_00000004, step_00000008 in .*\); a fresh run "
            r"\(train.resume=never\) there would save below them.*Use another train.output_dir")):
        _trainer(tmp_path, steps=8, resume="never").resume()
    with pytest.raises(ckpt.CheckpointError, match=r"beyond step 4 \(step_00000008 in .*\); a run resumed from step 4"):
        _trainer(tmp_path, steps=8, resume=str(root / "step_00000004")).resume()
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step_00000004", "step_00000008"]
    # resuming from there into a fresh output_dir is the way, and moving the later one aside works too
    elsewhere = tmp_path / "branch"
    assert _trainer(elsewhere, steps=8, resume=str(root / "step_00000004")).resume().step == 4
    (root / "step_00000008").rename(tmp_path / "step_00000008.old")
    assert _trainer(tmp_path, steps=8, resume=str(root / "step_00000004")).resume().step == 4


def test_pruning_keeps_the_checkpoint_just_written(tmp_path):
    """keep_last counts back from the step just saved: a stale later checkpoint (a folder put back
    by hand, say) is neither counted as newer nor a reason to delete the new one."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())

    def save(step, keep_last):
        return ckpt.save_checkpoint(run_dir=tmp_path, step=step, strategy="single", model=model,
                                    optimizer=optimizer, engine=None, group=None, keep_last=keep_last,
                                    state={"step": step, "skipped_steps": 0, "consumed_ids": [[]]})  # fmt: skip

    for step in (100, 200, 1000):
        save(step, keep_last=5)
    saved = save(300, keep_last=2)
    assert saved.is_dir()
    names = [p.name for p in ckpt.complete_checkpoints(tmp_path)]
    assert names == ["step_00000200", "step_00000300", "step_00001000"]
    save(400, keep_last=1)
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step_00000400", "step_00001000"]
