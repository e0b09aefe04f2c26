"""Export, round 12: a run directory's newest checkpoint pruned by the still-running training
while the export reads it (train.keep_last) is not an error; the export reads the newer one."""

from __future__ import annotations

import shutil

import pytest
import torch
from dspark_helpers import tiny_draft
from test_export_r11 import _checkpoint as training_checkpoint

from draftforge.errors import InputError
from draftforge.train import export as export_module
from draftforge.train.export import load_training_checkpoint


def _checkpoint(run, step, model):
    """Run ``run``'s complete checkpoint ``step`` of ``model``."""
    folder = training_checkpoint(run / "checkpoints" / f"step_{step:08d}", model)
    (folder / "COMPLETE").touch()
    (folder / "trainer_state.json").write_text("{}")  # complete, as resume reads it
    return folder


def _prune_on_first_read(monkeypatch, run, newer_model, step=6):
    """The training saves step ``step`` and prunes (keep_last 1) the checkpoint the export
    has picked, just before the export reads its weights."""
    real_read, seen = export_module.read_safetensors_file, []

    def read(path):
        seen.append(path)
        if len(seen) == 1:
            _checkpoint(run, step, newer_model)
            shutil.rmtree(path.parent)
        return real_read(path)

    monkeypatch.setattr(export_module, "read_safetensors_file", read)
    return seen


def test_a_run_directory_whose_checkpoint_is_pruned_while_read_gives_the_newer_one(tmp_path, monkeypatch, capsys):
    run, old, new = tmp_path / "run", tiny_draft(seed=1), tiny_draft(seed=2)
    _checkpoint(run, 4, old)
    seen = _prune_on_first_read(monkeypatch, run, new)
    cfg, state = load_training_checkpoint(run)
    assert [p.parent.name for p in seen] == ["step_00000004", "step_00000006"]
    assert torch.equal(state["fc.weight"], new.fc.weight)
    assert "step_00000004 was removed while it was read" in capsys.readouterr().out


def test_a_checkpoint_folder_named_directly_and_pruned_while_read_is_an_input_error(tmp_path, monkeypatch):
    """A checkpoint the user named is not swapped for another: the error says what happened."""
    run = tmp_path / "run"
    folder = _checkpoint(run, 4, tiny_draft(seed=1))
    _prune_on_first_read(monkeypatch, run, tiny_draft(seed=2))
    with pytest.raises(InputError, match=r"step_00000004: .*removed while it was read"):
        load_training_checkpoint(folder)


def test_a_folder_that_never_was_is_not_called_pruned(tmp_path):
    with pytest.raises(InputError) as err:
        load_training_checkpoint(tmp_path / "typo")
    assert "removed while it was read" not in str(err.value)
    assert str(err.value).startswith(f"{tmp_path / 'typo'} does not exist")
