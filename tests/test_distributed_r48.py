"""DeepSpeed's config says the bf16 overflow check the trainer's step skipping relies on
(session 48 review: only DeepSpeed's own default had it on, and only since 0.19)."""

import pytest

from draftforge.train.distributed import deepspeed_config


def test_bf16_asks_for_the_overflow_check_that_drops_a_nan_step():
    config = deepspeed_config(zero_stage=2, bf16=True, max_grad_norm=1.0)
    assert config["bf16"] == {"enabled": True, "check_grad_overflow": True}
    precision = pytest.importorskip("deepspeed.runtime.precision_config")
    # DeepSpeed's own parser takes it as meant
    assert precision.DeepSpeedBF16Config(**config["bf16"]).check_grad_overflow is True
