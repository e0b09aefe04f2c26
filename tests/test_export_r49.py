"""Review round 49 of loading an export: a config.json SGLang's DSPARK loader refuses is refused."""

from __future__ import annotations

import pytest
import torch
from dspark_helpers import tiny_draft

from draftforge.train.export import ExportError, serving_config
from draftforge.train.hf_load import config_from_serving


def test_a_config_carrying_speculators_model_type_dspark_is_refused():
    """SGLang refuses such a draft (contract section 4): draftforge eval measured it anyway."""
    raw = serving_config(tiny_draft().config, arch="Qwen3DSparkModel", dtype=torch.float32)
    assert config_from_serving(raw, where="x/config.json").block_size == tiny_draft().config.block_size
    with pytest.raises(ExportError, match="^x/config.json: speculators_model_type is 'dspark', which SGLang"):
        config_from_serving(dict(raw, speculators_model_type="dspark"), where="x/config.json")
