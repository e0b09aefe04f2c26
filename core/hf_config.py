"""Facts read from a Hugging Face ``config.json``, shared by the target registry and the
exported-draft loader (neither of which should import the other)."""

from __future__ import annotations


def rope_theta_of(config: dict) -> float | None:
    """The RoPE base of a config.json: top-level ``rope_theta`` (transformers 4),
    ``rope_parameters.rope_theta`` (transformers 5 writes it there), or, where
    ``rope_parameters`` is given per layer type (Gemma 3: ``{"full_attention": {...},
    "sliding_attention": {...}}``), the full-attention layers' one; None when none of these."""
    if config.get("rope_theta") is not None:
        return float(config["rope_theta"])
    parameters = config.get("rope_parameters")
    if isinstance(parameters, dict) and isinstance(parameters.get("full_attention"), dict):
        parameters = parameters["full_attention"]  # the sliding layers' base is a local one
    if isinstance(parameters, dict) and parameters.get("rope_theta") is not None:
        return float(parameters["rope_theta"])
    return None
