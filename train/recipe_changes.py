"""What a resumed run changes of the recipe its checkpoint was trained with, said at resume.

A resume refuses another draft shape, trainer count or strategy, and notes a changed
``train.seed``, learning-rate schedule or AdamW setting (``train/trainer.py``). Every other
setting that decides what the steps after the checkpoint train (``train.grad_accum``,
``split.token_budget``, ``data.shuffle_seed``, ``target.generation.*``, the loss weights, the
dtype, ...) was accepted without a word, so a rerun with an override silently stopped
repeating the checkpointed run. The checkpoint keeps the resolved recipe it was trained
with (``recipe.yaml``); a resume compares it with its own, key by key, and names each
difference except those that cannot change what is trained: where the run writes and logs,
how often it saves, and the evaluation and export sections, which training never reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from draftforge.recipe_errors import RecipeError
from draftforge.recipe_yaml import read_yaml
from draftforge.train.checkpoint import RECIPE_FILE

# keys (or whole sections, ending in ".") that do not change what the steps train
NOT_TRAINED = (
    "name", "target.cache_dir", "target.sglang_mem_fraction",
    "data.overlap_check", "data.overlap_threshold",
    "split.restart_target", "split.peer_timeout_s",
    "train.output_dir", "train.checkpoint_interval", "train.keep_last", "train.resume",
    "train.log_interval", "train.wandb", "train.wandb_mode", "train.tensorboard",
    "train.max_bad_steps", "eval.", "export.",
)
# said by the trainer's own notes, with what they do to the next step
NOTED_ELSEWHERE = (
    "train.seed", "train.lr", "train.steps", "train.warmup_ratio", "train.min_lr_ratio",
    "train.weight_decay", "train.adam_beta1", "train.adam_beta2", "train.adam_eps",
)


def _flattened(tree: object, prefix: str = "") -> dict[str, object]:
    """``{"a.b": value}`` for every leaf of nested mappings; lists are leaves."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, object] = {}
    for key, value in tree.items():
        flat.update(_flattened(value, f"{prefix}{key}."))
    return {key.removesuffix("."): value for key, value in flat.items()}


def _listed(key: str, names: tuple[str, ...]) -> bool:
    """Whether the dotted ``key`` is one of ``names`` or inside a section listed there."""
    return any(key == name or (name.endswith(".") and f"{key}.".startswith(name)) for name in names)


def _exempt(key: str) -> bool:
    return _listed(key, (*NOT_TRAINED, *NOTED_ELSEWHERE))


def without_untrained(tree: object, prefix: str = "") -> object:
    """A resolved recipe (nested mappings, as ``yaml.safe_load`` reads it) without the
    ``NOT_TRAINED`` settings: two runs whose recipes are equal after it trained alike."""
    if not isinstance(tree, dict):
        return tree
    return {key: without_untrained(value, f"{prefix}{key}.") for key, value in tree.items()
            if not _listed(f"{prefix}{key}", NOT_TRAINED)}


_ABSENT = object()


def _shown(value: object) -> str:
    return "(absent)" if value is _ABSENT else json.dumps(value)


def recipe_changes(saved_yaml: str, current_yaml: str) -> list[str]:
    """``key: old -> new`` for each setting that decides what is trained and differs between
    the two resolved recipes (YAML text, as ``RecipeConfig.to_yaml`` writes it), in key order."""
    saved, current = (_flattened(read_yaml(text, source) or {})
                      for text, source in ((saved_yaml, "the checkpoint's recipe"), (current_yaml, "this run's recipe")))
    return [f"{key}: {_shown(saved.get(key, _ABSENT))} -> {_shown(current.get(key, _ABSENT))}"
            for key in sorted(set(saved) | set(current))
            if not _exempt(key) and saved.get(key, _ABSENT) != current.get(key, _ABSENT)]


def resume_note(checkpoint: Path, current_yaml: str | None, *, next_step: int) -> str:
    """The note a resume from ``checkpoint`` prints when this run's recipe differs from the
    one it was trained with in what is trained, or "" (no difference, no recipe kept by the
    checkpoint, or none given for this run)."""
    saved_file = Path(checkpoint) / RECIPE_FILE
    if current_yaml is None or not saved_file.is_file():
        return ""
    try:
        changes = recipe_changes(saved_file.read_text(encoding="utf-8"), current_yaml)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecipeError) as exc:
        return f"{saved_file} could not be read to compare recipes ({type(exc).__name__}: {exc})"
    if not changes:
        return ""
    return (f"this recipe differs from the one {Path(checkpoint).name} was trained with ({saved_file}) "
            f"in what is trained: {'; '.join(changes)}. The steps from {next_step} on follow this "
            "recipe, so the run no longer repeats the checkpointed one; rerun with its settings to "
            "continue it exactly")
