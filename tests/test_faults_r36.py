"""Fault drills, round 36 (a tiny-debug run broken the way real jobs break): what a failed
checkpoint write says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from draftforge.train import checkpoint as ckpt

# -- 1. a full disk while safetensors writes a checkpoint file: the message names the file --


@pytest.mark.parametrize("failing", ["model.safetensors", "optimizer.safetensors"])
def test_a_full_disk_under_safetensors_names_the_file_it_was_writing(tmp_path, monkeypatch, failing):
    """safetensors' own error ("I/O error: No space left on device (os error 28)") names no
    file: on a full tmpfs the run stopped with a message that said neither which file nor
    where, although the README promises one line naming the file and the errno."""
    real_save = ckpt.save_file

    def full_disk(tensors, filename, *args, **kwargs):
        if Path(filename).name == failing:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real_save(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_file", full_disk)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    run_dir = tmp_path / "run"
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.save_checkpoint(run_dir=run_dir, step=10, strategy="single", model=model,
                             optimizer=optimizer, engine=None, state={"step": 10}, group=None,
                             keep_last=2)
    written = ckpt.checkpoint_path(run_dir, 10).with_name("step_00000010.tmp") / failing
    assert (f"(trainer rank 0: SafetensorError: Error while serializing: I/O error: No space left "
            f"on device (os error 28) (writing {written}));") in str(info.value)
    assert not list(ckpt.checkpoints_root(run_dir).iterdir())  # nothing partial left
