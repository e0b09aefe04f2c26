"""Round 6 of the draft model's review: what a config read back from disk may not hold."""

from __future__ import annotations

from dataclasses import asdict

import pytest
from dspark_helpers import tiny_config

from draftforge.train.export import ExportError
from draftforge.train.hf_load import config_from_serving


@pytest.mark.parametrize(("key", "value", "message"), [
    ("num_key_value_heads", 0, "num_key_value_heads must be a positive integer, got 0"),
    ("num_attention_heads", 0, "num_attention_heads must be a positive integer, got 0"),
    ("hidden_size", -32, "hidden_size must be a positive integer, got -32"),
    ("num_hidden_layers", 0, "num_hidden_layers must be a positive integer, got 0"),
    ("intermediate_size", 0, "intermediate_size must be a positive integer, got 0"),
    ("head_dim", 0, "head_dim must be a positive integer, got 0"),
    ("head_dim", 8.0, "head_dim must be an integer, got 8.0"),  # servers would read the float
    ("max_position_embeddings", 0, "max_position_embeddings must be a positive integer, got 0"),
    ("rms_norm_eps", 0.0, "rms_norm_eps must be a positive number, got 0.0"),
    ("rope_theta", -1.0, "rope_theta must be a positive number, got -1.0"),
])
def test_a_served_config_with_an_impossible_size_is_refused_naming_the_file_and_key(key, value, message):
    """Each of these config.json values used to load (or crash with ZeroDivisionError / a
    negative-dimension RuntimeError outside the ExportError the loaders promise)."""
    raw = asdict(tiny_config())
    raw[key] = value
    if key == "hidden_size":
        raw["target_hidden_size"] = value
    with pytest.raises(ExportError, match=f"^draft/config.json: {message}$"):
        config_from_serving(raw, where="draft/config.json")

