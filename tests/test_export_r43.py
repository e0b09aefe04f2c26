"""Round 43: export and checkpoint edges (advice on a broken checkpoint, a checkpoint without its
model file, an export on a file system without flock)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from dataclasses import asdict

import pytest
import torch
from dspark_helpers import tiny_draft

from draftforge.errors import InputError
from draftforge.train import checkpoint as ckpt
from draftforge.train.export import export_draft, load_training_checkpoint
from draftforge.train.hf_load import load_exported_draft


def _checkpoint_without_rng(folder):
    """A checkpoint folder that passes every check before the RNG files, and lacks them."""
    folder.mkdir(parents=True)
    (folder / ckpt.STATE_FILE).write_text(json.dumps(
        {"step": 1, "skipped_steps": 0, "strategy": "single", "consumed_ids": [["a"]]}))
    (folder / ckpt.COMPLETE).write_text("step 1\n")
    return folder


@pytest.mark.parametrize("earlier_name,resumable", [
    ("step_00000010", True),  # a real earlier checkpoint: the rerun resumes from it
    ("step_00000010.bak", False),  # a user's backup copy: resume ignores it
    ("step_00000010.tmp", False),  # a save killed after its marker, before its rename
])
def test_the_advice_on_a_broken_checkpoint_promises_a_resume_only_where_resume_finds_one(
        tmp_path, earlier_name, resumable):
    """The advice after deleting a broken checkpoint says whether the rerun resumes or starts
    over; it must agree with what resume: auto then picks (find_resume), so a complete-looking
    folder resume ignores (a .bak copy, a .tmp) must not be offered as "the previous checkpoint"."""
    run = tmp_path / "run"
    _checkpoint_without_rng(run / "checkpoints" / earlier_name)
    broken = _checkpoint_without_rng(run / "checkpoints" / "step_00000020")
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.read_checked_state(broken)
    message = str(info.value)
    assert message.startswith(f"checkpoint {broken} has no rng/rank_0.safetensors; it is incomplete")
    shutil.rmtree(broken)  # what the advice says to do
    picked = ckpt.find_resume(run, "auto")  # what the rerun then does
    assert (picked is not None) == resumable
    if resumable:
        assert picked.name == earlier_name
        assert message.endswith("delete it to resume from the previous complete checkpoint")
    else:
        assert message.endswith("delete it and rerun: the run starts over, as no earlier complete "
                                "checkpoint exists")


def _partial_copy(folder, model):
    """A checkpoint copied without its model.safetensors: marker, state and draft config only."""
    folder.mkdir(parents=True)
    (folder / "draft_config.json").write_text(json.dumps(asdict(model.config)))
    (folder / ckpt.STATE_FILE).write_text(json.dumps({"step": int(folder.name[5:])}))
    (folder / ckpt.COMPLETE).write_text("done\n")
    return folder


@pytest.mark.parametrize("named", ["run", "checkpoint"])
def test_a_checkpoint_without_its_model_file_is_named_as_a_checkpoint(tmp_path, named):
    """A checkpoint (its COMPLETE marker is there, the very folder resume would pick) copied
    without its model.safetensors: not "neither a checkpoint folder nor a run directory", nor
    "pass a run directory" to a user who passed one; the message names the checkpoint and says
    the file is what it lacks."""
    run = tmp_path / "run"
    folder = _partial_copy(run / "checkpoints" / "step_00000004", tiny_draft())
    assert ckpt.find_resume(run, "auto") == folder  # resume calls it a complete checkpoint
    source = run if named == "run" else folder
    with pytest.raises(InputError) as info:
        load_training_checkpoint(source)
    message = str(info.value)
    assert f"checkpoint {folder} has no model.safetensors (it has its COMPLETE marker)" in message
    assert message.startswith(f"{run}: its newest" if named == "run" else f"checkpoint {folder}")
    assert "neither a checkpoint folder" not in message and "pass a run directory" not in message
    assert "copy the checkpoint whole, or export another one" in message


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_an_export_on_a_file_system_without_flock_runs_unlocked(tmp_path, monkeypatch, code):
    """Training runs unlocked where the file system has no flock (some network ones); the export of
    its run there must not fail on the lock ("No locks available") with advice to free space. It
    writes the same folder as a locked export, leaves no lock file, and, unable to tell a running
    export's staging folder from a killed one's, removes none."""
    model = tiny_draft().eval()
    reference = export_draft(model, tmp_path / "locked" / "export", progress=lambda _: None)

    def no_flock(fd, how):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    parent = tmp_path / "nfs"
    parent.mkdir()
    other = parent / ".export.tmp-running"  # another export's staging folder, as far as it can tell
    other.mkdir()
    lines = []
    out = export_draft(model, parent / "export", progress=lines.append)
    assert sorted(p.name for p in parent.iterdir()) == [".export.tmp-running", "export"]
    assert any("no file locks (flock)" in line for line in lines)
    for name in ("config.json", "model.safetensors", "README.md"):
        assert (out / name).read_bytes() == (reference / name).read_bytes()
    loaded = load_exported_draft(out, embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_an_export_of_a_run_takes_the_checkpoint_resume_takes(tmp_path):
    """A newest step with its COMPLETE marker but no trainer_state.json (a copy cut short) is no
    checkpoint to resume: ``resume: auto`` takes the step before it, and so does an export of the
    run, where it used to export the newest marker."""
    from test_export_r11 import _checkpoint as training_checkpoint

    run = tmp_path / "run"
    models = {4: tiny_draft(seed=1), 8: tiny_draft(seed=2)}
    for step, model in models.items():
        folder = training_checkpoint(run / "checkpoints" / f"step_{step:08d}", model)
        (folder / ckpt.COMPLETE).write_text("done\n")
    (run / "checkpoints" / "step_00000004" / ckpt.STATE_FILE).write_text(json.dumps({"step": 4}))
    assert ckpt.find_resume(run, "auto") == run / "checkpoints" / "step_00000004"
    _, state = load_training_checkpoint(run)
    assert torch.equal(state["fc.weight"], models[4].fc.weight)


@pytest.mark.parametrize("kind", ["dangling link", "folder"])
def test_an_export_whose_weights_file_is_a_dangling_link_or_a_folder_says_so(tmp_path, kind):
    """``model.safetensors`` is there but holds no file (a hub cache's link whose blob was
    removed, or a folder): the message names it, not "neither model.safetensors nor ..."."""
    from draftforge.train.hf_load import read_safetensors_folder

    out = tmp_path / "export"
    out.mkdir()
    if kind == "dangling link":
        (out / "model.safetensors").symlink_to(tmp_path / "blobs" / "gone")
        expected = f"{out / 'model.safetensors'} is a link to {tmp_path / 'blobs' / 'gone'}, which does not exist"
    else:
        (out / "model.safetensors").mkdir()
        expected = f"{out / 'model.safetensors'} is not a file"
    with pytest.raises(InputError) as info:
        read_safetensors_folder(out)
    assert str(info.value).startswith(expected), str(info.value)
    assert "neither" not in str(info.value)


def test_a_path_that_does_not_exist_is_named_as_missing(tmp_path, capsys):
    """``draftforge eval`` of a mistyped path: "does not exist", as ``draftforge export`` says,
    not "no model.safetensors found at <typo>/model.safetensors" as if it were a folder."""
    from draftforge.cli import main

    typo = tmp_path / "runs" / "smolm2-cpu"
    with pytest.raises(InputError, match=rf"^{typo} does not exist; give a run directory"):
        load_training_checkpoint(typo)
    recipe = os.path.join(os.path.dirname(__file__), "..", "recipes", "tiny-debug.yaml")
    assert main(["eval", str(typo), "--recipe", recipe, "--out", str(tmp_path / "eval")]) == 2
    err = capsys.readouterr().err
    assert f"{typo} does not exist; give a run directory" in err and "found at" not in err
