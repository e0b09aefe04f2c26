"""The launcher's file check (before torchrun starts, before any target loads) refuses a
DeepSpeed checkpoint of another ZeRO stage or precision, as trainer rank 0 does after the
targets have loaded (tests/test_ckpt_r15.py checks that refusal itself)."""

from __future__ import annotations

from pathlib import Path

import pytest
from splitserve_helpers import tiny_recipe
from test_ckpt_r15 import _deepspeed_folder

from draftforge.config import load_recipe
from draftforge.splitserve.launch import preflight
from draftforge.train import checkpoint as ckpt


@pytest.mark.parametrize(("stage", "prefix", "wrong"), [
    (3, "", "was written with train.zero_stage=3, this run uses 2"),
    (2, "bf16_", "was written with train.dtype=bfloat16, this run uses float32"),
])
def test_preflight_refuses_a_deepspeed_checkpoint_of_another_stage_or_dtype(tmp_path, stage, prefix, wrong):
    recipe = tiny_recipe(tmp_path, trainers=2, overrides={
        "train.strategy": "deepspeed", "train.zero_stage": 2, "train.dtype": "float32"})
    cfg = load_recipe(recipe)
    _deepspeed_folder(Path(cfg.train.output_dir), ranks=2, stage=stage, prefix=prefix)
    with pytest.raises(ckpt.CheckpointError, match=wrong):
        preflight(cfg)
