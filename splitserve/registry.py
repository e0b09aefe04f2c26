"""Targets known by name, and the shapes the recipe checks need before loading."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from draftforge.errors import InputError
from draftforge.hf_config import rope_theta_of
from draftforge.splitserve.config import TargetConfig, TargetShape

# Shapes of the named targets, read off their config.json files, so recipes can
# be validated (layer ids, mask token) before the weights are converted.
KNOWN_TARGETS: dict[str, TargetShape] = {
    "smollm2-135m-instruct": TargetShape(
        num_hidden_layers=30,
        hidden_size=576,
        vocab_size=49152,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        head_dim=64,
        tie_word_embeddings=True,
        num_parameters=134_515_008,
    ),
}


def resolve_target_shape(target: TargetConfig, *, strict: bool = False) -> TargetShape | None:
    """The target's shape without loading weights, or None when it cannot be known yet.

    A declared ``target.shape`` overrides only the fields it sets: the rest come from the
    target's own config (registered, or its folder's config.json) when that can be read,
    and from the section's defaults only when it cannot (a dry run without the weights).
    The fields read from a config.json are the shape's ``model_fields_set``. ``strict``:
    a config.json that does not give a shape (a field missing or null, as GPT-2's ``n_layer``
    for ``num_hidden_layers``) raises a ValueError naming it and the field, instead of None.
    """
    if target.shape is None:
        return _known_shape(target.model, strict=strict)
    try:
        known = _known_shape(target.model, strict=False)
    except (OSError, ValueError):
        known = None
    if known is None:
        return target.shape
    declared = {field: getattr(target.shape, field) for field in target.shape.model_fields_set}
    return known.model_copy(update=declared)


class DraftNotTarget(InputError):
    """target.model (or eval's --target) names a draft's folder: said even where the recipe
    declares target.shape, which otherwise stands in for a config.json that cannot be read."""


def _known_shape(model: str, *, strict: bool) -> TargetShape | None:
    """The shape of a registered target or of a local folder's config.json; None otherwise."""
    if model in KNOWN_TARGETS:
        return KNOWN_TARGETS[model]
    config_path = Path(model).expanduser() / "config.json"
    if config_path.is_file():
        try:
            raw = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise InputError(
                f"{config_path} is not valid JSON ({exc.msg}: line {exc.lineno} column {exc.colno})"
            ) from None
        if not isinstance(raw, dict):
            raise InputError(f"{config_path} holds a JSON {type(raw).__name__}, not an object")
        if "block_size" in raw and "target_layer_ids" in raw:  # read as a 1-layer target otherwise
            named = f", architectures {raw['architectures']}" if raw.get("architectures") else ""
            raise DraftNotTarget(
                f"{config_path.parent} is a draft (its config.json has block_size and "
                f"target_layer_ids{named}), not a target model: name the model the draft "
                "speculates for (target.model, or eval's --target)")
        text_config = raw.get("text_config")
        if text_config is not None and not isinstance(text_config, dict):
            raise InputError(f"{config_path}: text_config holds a JSON {type(text_config).__name__}, "
                             "not an object (the text model's settings)")
        raw = raw if text_config is None else text_config
        fields = {k: raw[k] for k in TargetShape.model_fields if k in raw}
        try:
            theta = rope_theta_of(raw)
        except ValueError as exc:  # a base that is no JSON number, named by its key
            raise InputError(f"{config_path}: {exc}") from None
        if theta is not None:
            fields["rope_theta"] = theta
        try:
            return TargetShape(**fields)
        except ValidationError as exc:
            if not strict:
                return None
            problems = []
            for error in exc.errors():
                field = ".".join(str(part) for part in error["loc"])
                if error["type"] == "missing":
                    problems.append(f"no {field}")
                else:
                    problems.append(f"{field}: {error['msg']}, got {json.dumps(error.get('input'))}")
            raise ValueError(f"{config_path}: {'; '.join(problems)}") from None
    return None


def target_head_dim(shape: TargetShape) -> int:
    """The width of one of the target's attention heads: ``shape.head_dim`` where given
    (declared, or read from the folder's config.json by :func:`resolve_target_shape`),
    else ``hidden_size / num_attention_heads``."""
    return shape.head_dim or shape.hidden_size // shape.num_attention_heads


def rope_theta_problem(cfg) -> str | None:
    """Why a trainer cannot build the draft here, or None: the draft takes the target's RoPE
    base unless draft.rope_theta sets one, and the recipe loader leaves it unset where the
    target's config.json cannot be read, or gives no RoPE base, and target.shape does not
    declare it (a trainer
    node of a multi-node job without the target's folder would otherwise train with the
    section's default, 10000, and export that)."""
    if cfg.draft.rope_theta is not None:
        return None
    config_path = Path(cfg.target.model).expanduser() / "config.json"
    if config_path.is_file():
        return (
            f"draft.rope_theta: {config_path} gives no RoPE base draftforge can use (no "
            "rope_theta, nor a full_attention entry in per-layer-type rope_parameters); set "
            "draft.rope_theta to the target's RoPE base in the recipe"
        )
    return (
        f"draft.rope_theta: the target's RoPE base is not known on this machine "
        f"({cfg.target.model}/config.json cannot be read here and target.shape does not "
        "declare rope_theta); copy the target's config.json to that path, or declare "
        "target.shape.rope_theta (or draft.rope_theta) in the recipe"
    )
