"""Recipes: YAML files loaded into one strict, typed config tree.

``load_recipe`` reads a recipe, applies ``key.sub=value`` overrides from the
command line, validates every section against its pydantic model, then runs
the checks that need more than one section (target shape against the draft,
the process split) and fills in derived values. Every problem found is
collected and reported together as a :class:`RecipeError` whose lines name
where the value came from (``file:line`` or the override), the key path and
what is wrong::

    recipes/x.yaml:12: draft.markov_head_typ: unknown key (did you mean
    'markov_head_type'?); valid keys: attention_backend, block_size, ...
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError

from draftforge.data.config import DataConfig
from draftforge.eval.config import EvalConfig
from draftforge.files import write_atomic
from draftforge.recipe_checks import _cross_check
from draftforge.recipe_errors import (
    NONE_IS_A_STRING,
    KeyPath,
    RecipeError,
    _describe_all,
    _Locator,
    _nullable,
    _show,
    quote_advice,
)
from draftforge.recipe_yaml import (
    _apply_override,
    _line_column,
    _parse_yaml,
    _RecipeDumper,
    parse_override,
)
from draftforge.section import Section
from draftforge.splitserve.config import SplitConfig, TargetConfig
from draftforge.train.config import DraftConfig, ExportConfig, TrainConfig

__all__ = [
    "RecipeConfig",
    "RecipeError",
    "dump_recipe",
    "load_recipe",
    "parse_override",
    "validate_recipe",
]


class RecipeConfig(Section):
    """The whole recipe: one section per component."""

    name: str = Field(default="recipe", description="default: the recipe file's stem")
    target: TargetConfig = Field(default_factory=TargetConfig)
    draft: DraftConfig = Field(default_factory=DraftConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    split: SplitConfig = Field(default_factory=SplitConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    # where each key was set (file and line, or override), for checks made after loading
    _locator: _Locator | None = PrivateAttr(default=None)

    def locate(self, problem: str) -> str:
        """``problem`` ("split.key: what is wrong"), led by where that key was set: the recipe's
        file and line, or the override. A key left at its default is located, as
        :meth:`_Locator.line` does, where a key the problem names after it was set (the
        override first), else at its section. Unchanged for a recipe not loaded from a file,
        or when it does not start with a key."""
        key, _, rest = problem.partition(":")
        if self._locator is None or not re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)*", key):
            return problem
        sections = "|".join(SECTION_NAMES)
        related = tuple(tuple(name.split(".")) for name in
                        re.findall(rf"\b(?:{sections})(?:\.[a-z_0-9]+)+", rest) if name != key)
        return f"{self._locator.place(tuple(key.split('.')), related)}: {problem}"

    def override(self, key: str) -> str | None:
        """The command line's ``key=value`` that set ``key`` (``"train.resume=never"``), or None
        where the recipe's file or the default did: advice to set it otherwise must say to replace
        that override, since a key given twice is refused."""
        if self._locator is None:
            return None
        return self._locator.overrides.get(tuple(key.split(".")))

    def to_yaml(self, header: bool = True) -> str:
        """The resolved recipe (derived values filled in) as YAML that loads back unchanged."""
        data = self.model_dump(mode="json")
        if self.target.shape is not None:  # what is declared or read, not the section's defaults
            data["target"]["shape"] = self.target.shape.model_dump(mode="json", exclude_unset=True)
        body = yaml.dump(data, Dumper=_RecipeDumper, sort_keys=False, width=100)
        if not header:
            return body
        # repr: a name with a line break ("a\nb: 1") would end the comment and start a key
        return f"# draftforge resolved recipe {self.name!r}\n{body}"


SECTION_NAMES = tuple(name for name in RecipeConfig.model_fields if name != "name")


# --------------------------------------------------------------------------- entry points


def _fill_empty_sections(data: dict[str, Any], model: type[BaseModel]) -> None:
    """An empty section ("draft:" or "loss:" with nothing under it) means "all defaults", at
    every depth; an optional one (target.shape) stays null, which means none there."""
    for name, field in model.model_fields.items():
        section = field.annotation
        if name not in data or not (isinstance(section, type) and issubclass(section, BaseModel)):
            continue
        if data[name] is None:
            data[name] = {}
        if isinstance(data[name], dict):
            _fill_empty_sections(data[name], section)


def validate_recipe(
    data: Any,
    *,
    source: str = "<recipe>",
    name: str | None = None,
    overrides: Sequence[str] = (),
    lines: dict[KeyPath, int] | None = None,
    booleans: dict[KeyPath, str] | None = None,
) -> RecipeConfig:
    """Validate a raw recipe tree (as parsed from YAML) and return the resolved config.

    ``overrides`` (``key.sub=value``) are applied before validation. ``source``,
    ``lines`` and ``booleans`` (how each unquoted boolean was written, by key path) only
    shape the error messages; ``booleans`` also marks each unquoted ``None``, which a key
    that takes null refuses (YAML reads it as the string 'None'). Raises :class:`RecipeError`.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            [
                f"{source}: the top level must be a mapping of sections "
                f"({', '.join(SECTION_NAMES)}), got {_show(data)}"
            ]
        )
    data = copy.deepcopy(data)
    _fill_empty_sections(data, RecipeConfig)
    override_paths: dict[KeyPath, str] = {}
    given: dict[KeyPath, str] = {}  # the key paths each override gives a value, for the messages
    booleans = dict(booleans or {})
    for text in overrides:
        path, sets = _apply_override(data, text, booleans)
        if path in override_paths:  # the last would win silently
            raise RecipeError([f"command line {text!r}: {'.'.join(path)} is already set by "
                               f"{override_paths[path]!r}; give each key once"])
        for other, other_text in override_paths.items():
            # a key and the section holding it (train.loss.ce_weight=1 'train.loss={...}'): the
            # last would win silently, and an error would be blamed on the wrong one
            if path[: len(other)] == other or other[: len(path)] == path:
                raise RecipeError([f"command line {text!r}: {'.'.join(path)} overlaps "
                                   f"{other_text!r}, which sets {'.'.join(other)}; give each key once, "
                                   "in one of the two"])
        override_paths[path] = text
        given.update(dict.fromkeys(sets, text))
    # an empty override (train.loss= or train.loss=null) means "all defaults" too, as in the file
    _fill_empty_sections(data, RecipeConfig)
    if name is not None:
        data.setdefault("name", name)
    locator = _Locator(source, lines or {}, given)

    try:
        cfg = RecipeConfig.model_validate(data)
    except ValidationError as exc:
        problems = [locator.line(*problem)
                    for problem in _describe_all(exc.errors(), booleans, RecipeConfig, given)]
        raise RecipeError(problems) from None
    problems = [locator.line(path, f"{NONE_IS_A_STRING}, or quote it for the string"
                                   f"{quote_advice(path, 'None', path in given)}")
                for path, spelled in booleans.items() if spelled == "None" and _nullable(path, RecipeConfig)
                and _value_at(cfg, path) == "None"]  # export.out_dir=None: a folder ./None
    problems += [locator.line(*problem) for problem in _cross_check(cfg)]
    if problems:
        raise RecipeError(problems)
    cfg._locator = locator
    return cfg


def _value_at(cfg: RecipeConfig, path: KeyPath) -> Any:
    """The validated value at ``path`` (None where the path goes through a value)."""
    value: Any = cfg
    for part in path:
        if isinstance(part, int):
            value = value[part] if isinstance(value, list) and part < len(value) else None
        else:
            value = getattr(value, part, None) if isinstance(value, BaseModel) else None
    return value


def _string_keyed(data: Any) -> Any:
    """``data`` without the keys that are not strings (``1:``, ``~:``), at every depth."""
    if isinstance(data, dict):
        return {key: _string_keyed(value) for key, value in data.items() if isinstance(key, str)}
    if isinstance(data, list):
        return [_string_keyed(item) for item in data]
    return data


def load_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = (), *,
                reread: str | None = None) -> RecipeConfig:
    """Load, override, validate and resolve the recipe at ``path``.

    Raises :class:`RecipeError` listing every problem, each naming the file and
    line (or the override) and the key path. ``reread``: why the file is read again after
    this (say, by the job's ranks): a pipe or FIFO, which gives its text once, is then refused
    before it is read.
    """
    path = Path(path)
    source = str(path)
    if not path.exists():
        raise RecipeError([f"{source}: no such recipe file"])
    if path.is_dir():
        raise RecipeError([f"{source}: is a directory, expected a recipe .yaml file"])
    if reread is not None and not path.is_file():
        raise RecipeError([f"{source}: not a regular file (a pipe such as bash's <(...), or a FIFO), "
                           f"whose text can be read once, and {reread}: save the recipe to a file and "
                           "pass that"])
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise RecipeError([f"{source}: cannot read: {exc}"]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = raw[: exc.start].decode("utf-8")  # all good: the first bad byte is at exc.start
        line, column = _line_column(before, len(before))
        raise RecipeError(
            [
                f"{source}:{line}: not UTF-8 text: byte 0x{raw[exc.start]:02x} at column "
                f"{column} ({exc.reason}); save the recipe as UTF-8"
            ]
        ) from None
    data, lines, booleans, problems = _parse_yaml(text, source)
    if problems:  # duplicate or odd keys: report them with whatever else is wrong
        try:
            # without the odd keys, reported above at their lines
            validate_recipe(_string_keyed(data), source=source, name=path.stem, overrides=overrides,
                            lines=lines, booleans=booleans)
        except RecipeError as exc:
            problems += exc.problems
        raise RecipeError(problems)
    if data is None:
        raise RecipeError(
            [
                f"{source}: the recipe is empty; expected a mapping of sections "
                f"({', '.join(SECTION_NAMES)})"
            ]
        )
    if not isinstance(data, dict):
        raise RecipeError(
            [
                f"{source}:1: the top level must be a mapping of sections "
                f"({', '.join(SECTION_NAMES)}), got {_show(data)}"
            ]
        )
    return validate_recipe(data, source=source, name=path.stem, overrides=overrides, lines=lines,
                           booleans=booleans)


def dump_recipe(cfg: RecipeConfig, path: str | os.PathLike[str]) -> Path:
    """Write the resolved recipe to ``path`` atomically (temp file, then rename)."""
    path = Path(path)
    write_atomic(path, cfg.to_yaml().encode("utf-8"))
    return path
