"""Facts read from a Hugging Face ``config.json``, shared by the target registry and the
exported-draft loader (neither of which should import the other)."""

from __future__ import annotations


def rope_theta_of(config: dict) -> float | None:
    """The RoPE base of a config.json: top-level ``rope_theta`` (transformers 4),
    ``rope_parameters.rope_theta`` (transformers 5 writes it there), or, where
    ``rope_parameters`` is given per layer type (Gemma 3: ``{"full_attention": {...},
    "sliding_attention": {...}}``), the full-attention layers' one; None when none of these.
    A base that is no JSON number raises ``ValueError`` naming where it was read."""
    if config.get("rope_theta") is not None:
        return json_number(config["rope_theta"], "rope_theta")
    parameters, where = config.get("rope_parameters"), "rope_parameters"
    if isinstance(parameters, dict) and isinstance(parameters.get("full_attention"), dict):
        # the sliding layers' base is a local one
        parameters, where = parameters["full_attention"], "rope_parameters.full_attention"
    if isinstance(parameters, dict) and parameters.get("rope_theta") is not None:
        return json_number(parameters["rope_theta"], f"{where}.rope_theta")
    return None


def json_number(value, key: str) -> float:
    """``value`` as a float where it is a JSON number: ``float()`` would read ``"1e6"``, which
    servers do not, and ``true`` as 1.0, a RoPE base that silently changes every logit."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number, got {value!r}")
    return float(value)
