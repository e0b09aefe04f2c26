"""Facts read from a Hugging Face ``config.json``, shared by the target registry and the
exported-draft loader (neither of which should import the other)."""

from __future__ import annotations


def rope_theta_of(config: dict) -> float | None:
    """The RoPE base of a config.json: top-level ``rope_theta`` (transformers 4) or
    ``rope_parameters.rope_theta`` (transformers 5 writes it there); None when neither."""
    if "rope_theta" in config:
        return float(config["rope_theta"])
    parameters = config.get("rope_parameters")
    if isinstance(parameters, dict) and "rope_theta" in parameters:
        return float(parameters["rope_theta"])
    return None
