"""Session 51: DeepSpeed ZeRO-3 in bf16 on several trainers starts from the fp32 initial weights."""

from __future__ import annotations

import json

import pytest


def test_zero3_bf16_masters_on_two_trainers_start_from_the_fp32_initial_weights(tmp_path):
    """Writing the fp32 initial weights into the masters (session 50) went through DeepSpeed's
    full-tensor setter, which slices each rank's partition out of the full tensor: on the rank
    whose partition is all padding (a parameter smaller than, or not divisible by, the trainer
    count, such as the confidence head's one-element bias) the slice ran past the end and every
    ZeRO-3 bf16 run of two trainers or more failed at start."""
    pytest.importorskip("deepspeed")
    import torch.multiprocessing as mp
    from trainer_helpers import deepspeed_bf16_masters_worker

    out = str(tmp_path / "result")
    mp.spawn(deepspeed_bf16_masters_worker, args=(2, f"file://{tmp_path / 'store'}", out), nprocs=2, join=True)
    for rank in (0, 1):
        result = json.loads(open(f"{out}.{rank}").read())
        assert result["names"] and result["odd"] >= 1, result
        assert result["exact"] == result["total"], result
