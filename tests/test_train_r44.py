"""Round 44: resume puts back a checkpoint a killed re-save left only in its moved-aside copy,
export refuses a shard size that is no positive finite number, and the dry run builds its
meta-device draft once."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from dspark_helpers import tiny_draft

from draftforge.files import exclusive_lock
from draftforge.train import checkpoint as ckpt
from draftforge.train.export import export_draft, write_safetensors

ROOT = Path(__file__).resolve().parents[1]


def _complete(run: Path, step: int, tag: str) -> Path:
    """A checkpoint folder with what resume's selection reads: its marker and its state."""
    folder = ckpt.checkpoint_path(run, step)
    folder.mkdir(parents=True)
    (folder / ckpt.STATE_FILE).write_text(json.dumps({"step": step}))
    (folder / "tag.txt").write_text(tag)
    (folder / ckpt.COMPLETE).write_text(f"step {step}\n")
    return folder


def _killed_between_renames(folder: Path) -> Path:
    """What files.replace_dir leaves when killed after moving ``folder`` aside and before
    renaming the new one in: ``.NAME.old-*/NAME`` and nothing at NAME."""
    aside = folder.parent / f".{folder.name}.old-k1ll3d00"
    aside.mkdir()
    os.replace(folder, aside / folder.name)
    return aside


# --------------------------------------------------------------------------- 1. resume


def test_resume_auto_puts_back_a_checkpoint_left_only_moved_aside(tmp_path):
    run = tmp_path / "run"
    _complete(run, 4, "four")
    _killed_between_renames(_complete(run, 8, "eight"))
    assert not ckpt.checkpoint_path(run, 8).exists()

    found = ckpt.find_resume(run, "auto")

    assert found == ckpt.checkpoint_path(run, 8)
    assert (found / "tag.txt").read_text() == "eight"  # the moved-aside copy itself, whole
    assert [p.name for p in ckpt.complete_checkpoints(run)] == ["step_00000004", "step_00000008"]


def test_a_fresh_run_is_refused_above_a_checkpoint_left_only_moved_aside(tmp_path):
    run = tmp_path / "run"
    _killed_between_renames(_complete(run, 8, "eight"))

    with pytest.raises(ckpt.CheckpointError, match="step_00000008"):
        ckpt.find_resume(run, "never")
    assert (ckpt.checkpoint_path(run, 8) / "tag.txt").read_text() == "eight"


def test_resume_keeps_the_checkpoint_in_place_over_a_moved_aside_copy(tmp_path):
    run = tmp_path / "run"
    aside = _killed_between_renames(_complete(run, 8, "old"))
    _complete(run, 8, "new")  # the re-save got in: the aside copy is not the only one

    assert ckpt.find_resume(run, "auto") == ckpt.checkpoint_path(run, 8)
    assert (ckpt.checkpoint_path(run, 8) / "tag.txt").read_text() == "new"
    assert (aside / "step_00000008" / "tag.txt").read_text() == "old"  # left for the prune


def test_nothing_is_moved_while_another_run_holds_the_run_directory(tmp_path):
    """Another run's save may be between replace_dir's renames: its aside copy stays put."""
    run = tmp_path / "run"
    _complete(run, 4, "four")
    aside = _killed_between_renames(_complete(run, 8, "eight"))
    with exclusive_lock(run / ckpt.RUN_LOCK):
        assert ckpt.find_resume(run, "auto") == ckpt.checkpoint_path(run, 4)
    assert (aside / "step_00000008" / "tag.txt").read_text() == "eight"
    assert not ckpt.checkpoint_path(run, 8).exists()


# --------------------------------------------------------------------------- 2. shard size


@pytest.mark.parametrize("size", [0, -1, -0.5, math.nan, math.inf, -math.inf])
def test_export_refuses_a_shard_size_that_is_no_positive_finite_number(tmp_path, size):
    out = tmp_path / "export"
    with pytest.raises(ValueError, match=rf"max_shard_size_mb .*got {size!r}$"):
        export_draft(tiny_draft(), out, max_shard_size_mb=size, progress=lambda _: None)
    assert list(tmp_path.iterdir()) == []  # nothing written, no staging folder left


@pytest.mark.parametrize("size", [0, -2, math.nan, math.inf])
def test_write_safetensors_refuses_a_shard_size_that_is_no_positive_finite_number(tmp_path, size):
    with pytest.raises(ValueError, match=rf"max_shard_size_mb .*got {size!r}$"):
        write_safetensors(tiny_draft().state_dict(), tmp_path, max_shard_size_mb=size)
    assert list(tmp_path.iterdir()) == []


def test_a_small_positive_shard_size_still_shards(tmp_path):
    state = tiny_draft().state_dict()
    files = write_safetensors(state, tmp_path, max_shard_size_mb=1e-3)  # 1048 bytes
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").is_file()


# --------------------------------------------------------------------------- 3. dry run


def test_the_dry_run_builds_its_meta_draft_once(monkeypatch):
    """Under fsdp2 the trainer estimate reads the draft's units: from the same built draft."""
    from draftforge.config import load_recipe
    from draftforge.splitserve import dry_run as dr

    cfg = load_recipe(ROOT / "recipes/qwen3-8b-dspark.yaml", [])
    assert cfg.train.strategy == "fsdp2"
    built = []
    real = dr._meta_draft

    def counted(dspark_cfg):
        built.append(dspark_cfg)
        return real(dspark_cfg)

    monkeypatch.setattr(dr, "_meta_draft", counted)
    report = dr.dry_run(cfg)

    assert len(built) == 1
    # the same figures as the estimate built apart, with its own draft
    monkeypatch.setattr(dr, "_meta_draft", real)
    with_emb, without = dr.draft_parameter_counts(cfg)
    assert f"draft parameters: {with_emb:,} with embeddings, {without:,} without" in report
    lines = dr.trainer_estimate(cfg, with_emb, without).lines()
    assert "\n".join(lines) in report
