"""DeepSpeed on a trainer subgroup (gloo on CPU): the world holds a rank that never trains,
like a target rank under a split."""

from __future__ import annotations

import importlib.util
import json

import pytest
from test_trainer_distributed import ALL_ANCHORS, launch

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed==0.19.8)"),
]


def test_zero3_on_a_trainer_subgroup_is_refused_before_any_collective(tmp_path):
    """World of 3, ranks 1 and 2 asked to train with ZeRO-3, rank 0 stands in for a target rank.
    ZeRO-3 barriers the whole world while it builds its optimizer and broadcasts from global
    rank 0 every step; a target rank never joins, so the trainers used to wait on it (here they
    met rank 0's end-of-run barrier and crashed in DeepSpeed's init). Now both trainer ranks
    refuse it at once, naming the option and what to use instead."""
    train = dict(strategy="deepspeed", zero_stage=3, dtype="float32", steps=2, num_anchors=ALL_ANCHORS)
    with pytest.raises(AssertionError, match=r"exit codes \[\d, 1, 1\]"):
        launch(tmp_path, "zero3-sub", world=3, trainer_ranks=[1, 2], train=train, timeout=120,
               pg_timeout_s=30)
    for trainer_rank in (0, 1):
        error = json.loads((tmp_path / f"zero3-sub.json.rank{trainer_rank}.error").read_text())
        assert error["type"] == "InputError", error
        assert error["message"].startswith(
            "train.zero_stage=3 needs every rank of the job to train, but the trainer group holds "
            "2 of the 3 ranks"), error
        assert "use train.zero_stage=2 or train.strategy=fsdp2" in error["message"]
