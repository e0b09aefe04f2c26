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
import difflib
import os
import re
import types
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError

from draftforge.data.config import DataConfig
from draftforge.errors import InputError
from draftforge.eval.config import EvalConfig
from draftforge.files import write_atomic
from draftforge.section import Section
from draftforge.splitserve.config import SplitConfig, TargetConfig, TargetShape
from draftforge.splitserve.registry import KNOWN_TARGETS, resolve_target_shape
from draftforge.train.config import DraftConfig, ExportConfig, TrainConfig, warmup_steps

__all__ = [
    "RecipeConfig",
    "RecipeError",
    "dump_recipe",
    "load_recipe",
    "parse_override",
    "validate_recipe",
]

KeyPath = tuple[str | int, ...]


class RecipeError(InputError):
    """A recipe (or an override of it) is invalid.

    ``problems`` holds one line per problem; ``str(error)`` joins them.
    """

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


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

    def __eq__(self, other: object) -> bool:  # the same settings, wherever they were read from
        if type(other) is not type(self):
            return NotImplemented
        return self.__dict__ == other.__dict__

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


class _RecipeDumper(yaml.SafeDumper):
    """Block-style mappings, with lists of plain values on one line (``[0, 1, 2]``)."""


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    flat = all(not isinstance(item, (dict, list)) for item in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


_RecipeDumper.add_representer(list, _represent_list)


SECTION_NAMES = tuple(name for name in RecipeConfig.model_fields if name != "name")


# --------------------------------------------------------------------------- YAML


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4`` as a float (YAML 1.1 wants ``1.0e-4``), and reads
    ``1:30`` and ``0b11`` as the strings YAML 1.2 reads, not 1.1's base-60 and binary numbers."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        """A scalar that its explicit tag cannot read (``!!int abc``) is an error at its line,
        not the ValueError (or KeyError, AttributeError) of PyYAML's constructor."""
        try:
            return super().construct_object(node, deep)
        except (ValueError, KeyError, AttributeError) as exc:
            if not isinstance(node, yaml.ScalarNode):
                raise
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {node.value!r} as {tag}", node.start_mark
            ) from exc


# YAML 1.1's numbers less base 60 (1:30 was 90, 12:30 a name's 750) and binary (0b11 was 3),
# which YAML 1.2 reads as strings: an int key refuses them by their text, a str key takes them.
# Hex (0x10 is 16, as in YAML 1.2) and underscores (1_000) read as before.
_INT = re.compile(r"^(?:[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$")
_FLOAT = re.compile(
    r"^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers
            if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:int", _INT, list("-+0123456789"))
_RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
_RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """Integers as YAML 1.2 reads them: a leading zero is decimal (``010`` is 10), not 1.1's octal."""
    text = loader.construct_scalar(node).replace("_", "")
    digits = text.lstrip("+-")
    if len(digits) > 1 and digits.startswith("0") and digits.isdigit():
        return int(text, 10)
    return yaml.SafeLoader.construct_yaml_int(loader, node)


_RecipeLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
# the writer knows the rule too, so that a string such as '1e5' is quoted and loads back a string
_RecipeDumper.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))


def _line_column(text: str, position: int) -> tuple[int, int]:
    """The 1-based line and column of the character at ``position`` in ``text``."""
    start = text.rfind("\n", 0, position) + 1
    return text.count("\n", 0, position) + 1, position - start + 1


def _parse_yaml(text: str, source: str) -> tuple[Any, dict[KeyPath, int], dict[KeyPath, str], list[str]]:
    """Parse YAML text: the data, the line of every key path, the spelling of every unquoted
    boolean (see _index_lines), and structural problems."""
    try:
        loader = _RecipeLoader(text)
    except yaml.reader.ReaderError as exc:  # a control character (ESC of a pasted colour code, NUL)
        line, column = _line_column(text, exc.position)
        raise RecipeError(
            [
                f"{source}:{line}: YAML syntax error: character #x{exc.character:04x} at "
                f"column {column} is not allowed in YAML; remove it"
            ]
        ) from None
    lines: dict[KeyPath, int] = {}
    booleans: dict[KeyPath, str] = {}
    problems: list[str] = []
    try:
        node = loader.get_single_node()
        _refuse_cycle(node, source)
        if node is not None:
            # before constructing: construction flattens merge keys (<<: *anchor) into the
            # mapping, and an explicit key beside a merged one would look duplicated
            _index_lines(node, (), lines, problems, source, booleans)
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        context = exc.context
        if context and exc.context_mark is not None and mark is not exc.context_mark \
                and exc.context_mark.line != mark.line:  # an unclosed quote: where it opened
            context = f"{context} (line {exc.context_mark.line + 1})"
        problem = ": ".join(p for p in (context, exc.problem) if p)
        raise RecipeError([f"{where}: YAML syntax error: {problem}"]) from None
    except yaml.YAMLError as exc:
        raise RecipeError([f"{source}: YAML syntax error: {exc}"]) from None
    finally:
        loader.dispose()
    return data, lines, booleans, problems


def _cycle(node: yaml.Node, inside: frozenset[int] = frozenset()) -> yaml.Node | None:
    """The first node that contains itself through an alias (``a: &x [*x]``), or None: a
    recipe is a tree, and walking such a node would never end."""
    if id(node) in inside:
        return node
    inside |= {id(node)}
    children = (
        [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
        else node.value if isinstance(node, yaml.SequenceNode) else []
    )  # fmt: skip
    return next((found for child in children if (found := _cycle(child, inside)) is not None), None)


def _refuse_cycle(node: yaml.Node | None, where: str, *, line: bool = True) -> None:
    found = _cycle(node) if node is not None else None
    if found is not None:
        at = f"{where}:{found.start_mark.line + 1}" if line else where
        raise RecipeError([f"{at}: YAML syntax error: an alias (*name) refers to a value that "
                           "contains it; a recipe is a tree, not a cycle"])


def _index_lines(
    node: yaml.Node,
    path: KeyPath,
    lines: dict[KeyPath, int],
    problems: list[str],
    source: str | None,
    booleans: dict[KeyPath, str],
) -> None:
    """Record the 1-based line of every key path, and in ``booleans`` how each unquoted boolean
    was written (``off``, ``no``: YAML 1.1 reads them as false), for the message of a key that
    wanted a string; report duplicate and non-string keys, led by ``source:line`` (nothing for
    a value given on the command line, whose caller says where).
    A key that a merge (``<<: *anchor``) brings in is at the line of that merge: the anchor's
    own lines are shared by every mapping that merges it."""
    at = (lambda line: f"{source}:{line}: ") if source is not None else (lambda line: "")
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        merged: dict[KeyPath, int] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                if key_node.tag == "tag:yaml.org,2002:merge":
                    # its problems are reported where the anchor is defined
                    sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                    for source_node in sources:
                        merged.update(dict.fromkeys(_key_paths(source_node, path), line))
                    continue
                shown = _dotted(path) or "top level"
                problems.append(
                    f"{at(line)}{shown}: keys must be plain names, got {key_node.value!r}"
                )
                continue
            key = key_node.value
            if key in seen:
                first = f" (first given at line {seen[key]})" if source is not None else ""
                problems.append(f"{at(line)}{_dotted(path + (key,))}: duplicate key{first}")
                for stale in [p for p in lines if p[: len(path) + 1] == path + (key,)]:
                    del lines[stale]  # the lines of the first value's keys, which YAML dropped
            else:
                seen[key] = line
            # YAML keeps the last value, so its problems are reported at the last line
            lines[path + (key,)] = line
            _index_lines(value_node, path + (key,), lines, problems, source, booleans)
        for merged_path, merged_line in merged.items():  # an explicit key replaces a merged one, whole
            if merged_path[len(path)] not in seen:
                lines[merged_path] = merged_line
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[path + (index,)] = item.start_mark.line + 1
            _index_lines(item, path + (index,), lines, problems, source, booleans)
    elif node.tag == "tag:yaml.org,2002:bool" and node.style is None:
        booleans[path] = node.value


def _key_paths(node: yaml.Node, path: KeyPath) -> list[KeyPath]:
    """Every key path a node gives under ``path``, merged keys included."""
    out: list[KeyPath] = []
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                for source_node in sources:
                    out += _key_paths(source_node, path)
            elif isinstance(key_node, yaml.ScalarNode) and key_node.tag == "tag:yaml.org,2002:str":
                out.append(path + (key_node.value,))
                out += _key_paths(value_node, path + (key_node.value,))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            out.append(path + (index,))
            out += _key_paths(item, path + (index,))
    return out


# --------------------------------------------------------------------------- overrides


def parse_override(text: str, booleans: dict[KeyPath, str] | None = None) -> tuple[tuple[str, ...], Any]:
    """Split ``key.sub=value`` into a key path and a YAML-parsed value; ``booleans``, when
    given, gets how each unquoted boolean in the value was written, by key path."""
    key, sep, raw = text.partition("=")
    where = f"command line {text!r}"
    if not sep:
        raise RecipeError([f"{where}: expected key.sub=value"])
    parts = tuple(part.strip() for part in key.split("."))
    if not all(parts):
        raise RecipeError([f"{where}: empty key part in {key!r}; expected e.g. draft.block_size=8"])
    problems: list[str] = []
    try:
        loader = _RecipeLoader(raw)
        try:
            node = loader.get_single_node()
            _refuse_cycle(node, where, line=False)
            if node is not None:  # duplicate and non-string keys, as in a file
                _index_lines(node, parts, {}, problems, None, {} if booleans is None else booleans)
            value = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        raise RecipeError([f"{where}: value is not valid YAML: {problem}"]) from None
    if problems:
        raise RecipeError([f"{where}: {problem}" for problem in problems])
    return parts, value


def _apply_override(
    data: dict[str, Any], text: str, booleans: dict[KeyPath, str]
) -> tuple[tuple[str, ...], list[KeyPath]]:
    """Set one override in the raw tree (before validation); return its key path and the key
    paths it gives a value: that path, or for a mapping merged into a section only the keys
    the mapping lists (the section's other keys are still where the recipe set them)."""
    parts, value = parse_override(text, booleans)
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            prefix = ".".join(parts[: depth + 1])
            raise RecipeError(
                [
                    f"command line {text!r}: {prefix} is a value, not a section; cannot set {'.'.join(parts)}"
                ]
            )
        else:  # a copy: a YAML alias shares this mapping with other keys, which keep their values
            child = node[part] = dict(child)
        node = child
    current = node.get(parts[-1])
    if isinstance(value, dict) and isinstance(current, dict):
        # a mapping merges into the section it names: train.loss={ce_weight: 1} changes
        # ce_weight and keeps the recipe's other loss settings
        node[parts[-1]] = _merged(current, value)
        return parts, [parts + leaf for leaf in _leaves(value)]
    node[parts[-1]] = value
    return parts, [parts]


def _leaves(mapping: dict[Any, Any], prefix: KeyPath = ()) -> list[KeyPath]:
    """The key paths of a mapping's values, nested mappings followed down (an empty one is a value)."""
    out: list[KeyPath] = []
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            out += _leaves(value, prefix + (key,))
        else:
            out.append(prefix + (key,))
    return out


def _merged(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


# --------------------------------------------------------------------------- errors


def _dotted(path: Iterable[str | int]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _show(value: Any) -> str:
    """``str '8'``, ``int 8``, ``null``: a value with its YAML-ish type name."""
    if value is None:
        return "null"
    kind = {dict: "mapping", list: "list", str: "str", bool: "bool", int: "int", float: "float"}
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{kind.get(type(value), type(value).__name__)} {text}"


_EXPECTED = {
    "int_type": "int",
    "int_parsing": "int",
    "int_from_float": "int",
    "float_type": "float",
    "float_parsing": "float",
    "bool_type": "bool",
    "bool_parsing": "bool",
    "string_type": "str",
    "list_type": "list",
    "dict_type": "a mapping",
    "model_type": "a mapping of keys",
    "model_attributes_type": "a mapping of keys",
}


def _unwrap(annotation: Any) -> Any:
    """Strip ``X | None`` down to X."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])
    return annotation


def _walk(loc: Sequence[str | int]) -> tuple[KeyPath, Any]:
    """Follow a pydantic error location through the models.

    Returns the key path (union/member tags dropped) and the annotation that the
    last element refers to (a model class, a Literal, ...), or None.
    """
    path: list[str | int] = []
    current: Any = RecipeConfig
    for part in loc:
        current = _unwrap(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            path.append(part)
            field = current.model_fields.get(part) if isinstance(part, str) else None
            current = field.annotation if field is not None else None
        elif typing.get_origin(current) in (list, tuple) and isinstance(part, int):
            path.append(part)
            args = typing.get_args(current)
            current = args[0] if args else None
        elif isinstance(part, int):
            path.append(part)
            current = None
        # else: a union member tag such as 'int' or 'function-after[...]': skip it
    return tuple(path), _unwrap(current)


def _model_at(path: KeyPath) -> type[BaseModel] | None:
    _, annotation = _walk(path)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _describe(error: dict[str, Any], booleans: dict[KeyPath, str]) -> tuple[KeyPath, str]:
    """A pydantic error as (key path, problem text); ``booleans`` as _index_lines records them."""
    loc = tuple(error["loc"])
    kind = error["type"]
    value = error.get("input")
    if kind == "extra_forbidden":
        path, _ = _walk(loc)
        model = _model_at(path[:-1]) if path else None
        valid = sorted(model.model_fields) if model is not None else []
        key = str(path[-1]) if path else "?"
        hint = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
        return path, f"unknown key{did_you_mean}; valid keys: {', '.join(valid)}"
    path, annotation = _walk(loc)
    # off, no, yes: unquoted, YAML 1.1 reads these as booleans where a string was meant
    spelled = booleans.get(path) if isinstance(value, bool) else None
    if kind == "literal_error":
        choices = typing.get_args(annotation) if typing.get_origin(annotation) is Literal else ()
        if choices:
            listed = ", ".join(repr(c) for c in choices)
            hint = ""
            if isinstance(value, str):
                quoted = [c for c in choices if not isinstance(c, str) and str(c) == value]
                if quoted:  # '2' for the integer 2: the quotes made it a string
                    hint = f" (write it without quotes: {quoted[0]!r})"
                else:
                    close = difflib.get_close_matches(value, [str(c) for c in choices], n=1, cutoff=0.6)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
            elif spelled is not None:
                hint = f" (unquoted {spelled} is a boolean in YAML, not the string {spelled!r})"
            return path, f"{value!r} is not one of {listed}{hint}"
        return path, f"{value!r} is not one of {error.get('ctx', {}).get('expected', '?')}"
    if kind == "missing":
        return path, "required key missing"
    if kind in _EXPECTED:
        hint = ""
        if kind == "string_type" and spelled is not None:
            hint = f" (unquoted {spelled} is a boolean in YAML; quote it: {spelled!r})"
        return path, f"expected {_EXPECTED[kind]}, got {_show(value)}{hint}"
    message = str(error.get("msg", kind))
    if message.startswith("Value error, "):
        return path, message[len("Value error, ") :]
    message = message.replace("Input should be", "must be")
    return path, f"{message}, got {_show(value)}"


def _describe_all(errors: Sequence[dict[str, Any]], booleans: dict[KeyPath, str]) -> list[tuple[KeyPath, str]]:
    """Every pydantic error as (key path, problem text); a value that fits no member of a union
    (``train.loss.compile``: a bool or 'auto') is one problem naming every member, not one
    contradicting problem per member (their locations end in a member tag)."""
    out: list[tuple[KeyPath, str]] = []
    members: dict[KeyPath, tuple[int, list[str], Any]] = {}  # path: (index in out, expected, value)
    for error in errors:
        loc = tuple(error["loc"])
        path, _ = _walk(loc)
        if path == loc:
            out.append(_describe(error, booleans))
            continue
        kind = error["type"]
        expected = (str(error.get("ctx", {}).get("expected", "?")) if kind == "literal_error"
                    else _EXPECTED.get(kind) or _describe(error, booleans)[1])
        if path not in members:
            members[path] = (len(out), [], error.get("input"))
            out.append((path, ""))
        members[path][1].append(expected)
    for path, (index, expected, value) in members.items():
        out[index] = (path, f"expected {' or '.join(expected)}, got {_show(value)}")
    return out


class _Locator:
    """Says where a key path's value came from: an override or a line of the file."""

    def __init__(self, source: str, lines: dict[KeyPath, int], overrides: dict[KeyPath, str]):
        self.source = source
        self.lines = lines
        self.overrides = overrides

    def where(self, path: KeyPath) -> str:
        for end in range(len(path), 0, -1):
            if path[:end] in self.overrides:
                return f"command line {self.overrides[path[:end]]!r}"
        # a section or key that only an override created (``foo.bar=1``), or a key missing
        # from a section an override created (``target.shape.hidden_size=576`` alone)
        for end in range(len(path), 0, -1):
            if path[:end] in self.lines:
                break
            for override_path, text in self.overrides.items():
                if override_path[:end] == path[:end]:
                    return f"command line {text!r}"
        for end in range(len(path), 0, -1):
            if path[:end] in self.lines:
                return f"{self.source}:{self.lines[path[:end]]}"
        return self.source

    def given(self, path: KeyPath) -> bool:
        """Whether the file or an override sets ``path`` itself (not only the section it is in)."""
        return path in self.lines or any(path[:end] in self.overrides for end in range(len(path), 0, -1))

    def line(self, path: KeyPath, problem: str, related: Sequence[KeyPath] = ()) -> str:
        """``where: key: problem``. A problem of a key left at its default that another key
        brings about (``train.warmup_ratio`` with ``train.steps=1``) is located where one of the
        ``related`` keys was set (an override before the file), not at the line of the section."""
        key = _dotted(path)
        where = self.place(path, related)
        return f"{where}: {key}: {problem}" if key else f"{where}: {problem}"

    def place(self, path: KeyPath, related: Sequence[KeyPath] = ()) -> str:
        """Where :meth:`line` locates a problem of ``path``."""
        where = self.where(path)
        if not self.given(path):
            found = [self.where(other) for other in related if self.given(other)]
            where = next((w for w in found if w.startswith("command line")), found[0] if found else where)
        return where


# --------------------------------------------------------------------------- cross checks

# (key path, what is wrong) or (key path, what is wrong, related key paths): see _Locator.line
Problem = tuple[KeyPath, str] | tuple[KeyPath, str, tuple[KeyPath, ...]]


def _check_target(cfg: RecipeConfig) -> tuple[TargetShape | None, list[Problem]]:
    """Resolve the target's shape; check a declared shape against the known one."""
    target = cfg.target
    problems: list[Problem] = []
    try:
        shape = resolve_target_shape(target, strict=True)
    except (OSError, ValueError) as exc:
        return None, [(("target", "model"), (
            f"cannot use the target's config.json: {exc}; declare the target's shape under "
            "target.shape"))]
    if (target.shape is None and target.model != "random" and target.model not in KNOWN_TARGETS
            and not Path(target.model).expanduser().is_dir()):
        names = ", ".join([*KNOWN_TARGETS, "random"])
        return None, [(("target", "model"), (
            f"{target.model!r} is neither a registered name ({names}) nor an existing local "
            "folder; for a dry run without the target's weights, declare target.shape"))]
    if shape is None:  # an existing folder without a config.json: its parent, a hub cache's root
        config_json = Path(target.model).expanduser() / "config.json"
        return None, [(("target", "model"), (
            f"{target.model!r} holds no config.json ({config_json} is not a file), so the "
            "target's shape is unknown and the draft cannot be checked against it; point "
            "target.model at the folder with the model's config.json, or declare target.shape"))]
    if target.shape is None and shape is not None and target.model not in KNOWN_TARGETS:
        # a local folder's shape, recorded like a declared one: a run's config.yaml then
        # reloads (export, eval) on a machine without that folder
        target.shape = shape
    elif target.shape is not None and target.model != "random":
        try:
            known = resolve_target_shape(target.model_copy(update={"shape": None}))
        except (OSError, ValueError):
            known = None
        if known is not None:
            # only against what the target's config gives: a field it leaves out holds the
            # section's placeholder default, not the target's value (declaring it is the fix)
            for field in sorted(target.shape.model_fields_set & known.model_fields_set):
                declared, real = getattr(target.shape, field), getattr(known, field)
                if real is not None and declared != real:
                    problems.append(
                        (
                            ("target", "shape", field),
                            f"{declared!r} differs from {target.model}'s {field} {real!r}; "
                            "remove it or fix it",
                        )
                    )
            # The resolved recipe (config.yaml of a run) records the whole shape the run
            # used, so that reloading it, as export does, compares real values only.
            target.shape = shape
    if target.model == "random" and shape is not None:
        if shape.hidden_size % shape.num_attention_heads:
            problems.append(
                (
                    ("target", "shape", "hidden_size"),
                    f"{shape.hidden_size} is not divisible by num_attention_heads "
                    f"{shape.num_attention_heads}",
                )
            )
        if shape.num_attention_heads % shape.num_key_value_heads:
            problems.append(
                (
                    ("target", "shape", "num_key_value_heads"),
                    f"{shape.num_key_value_heads} does not divide num_attention_heads "
                    f"{shape.num_attention_heads}",
                )
            )
    return shape, problems


def _rope_theta_known(target) -> bool:
    """Whether the resolved shape's rope_theta is the target's: false when its config.json
    cannot be read here (a node without the target's folder) or gives no RoPE base (none
    written, or only per-layer-type ones without a full_attention entry) and target.shape
    does not declare it, where it is only the section's default."""
    if target.model == "random" or (target.shape is not None
                                    and "rope_theta" in target.shape.model_fields_set):
        return True
    try:
        known = resolve_target_shape(target.model_copy(update={"shape": None}))
    except (OSError, ValueError):
        return False
    return known is not None and "rope_theta" in known.model_fields_set


def _check_draft(cfg: RecipeConfig, shape: TargetShape | None) -> list[Problem]:
    """Check the draft against itself and the target; derive head_dim, rope and positions."""
    draft = cfg.draft
    problems: list[Problem] = []
    ids_path = ("draft", "target_layer_ids")
    ids = draft.target_layer_ids
    if not ids:
        problems.append((ids_path, "must list at least one target layer"))
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        problems.append((ids_path, f"duplicate layer ids {duplicates}"))
    for index, layer in enumerate(ids):
        if layer < 0:
            problems.append(
                (ids_path + (index,), f"layer id {layer} is negative; ids are 0-indexed")
            )
        elif shape is not None and layer >= shape.num_hidden_layers - 1:
            last = shape.num_hidden_layers - 1
            if layer == last:
                why = (
                    f"layer id {layer} is the target's final layer, which is not allowed "
                    f"(its output is the final-hidden stream)"
                )
            else:
                why = f"layer id {layer} is out of range: the target has {shape.num_hidden_layers} layers"
            problems.append((ids_path + (index,), f"{why}; valid ids are 0..{last - 1}",
                             (("target", "shape", "num_hidden_layers"), ("target", "model"))))

    if draft.max_position_embeddings is not None and draft.max_position_embeddings < cfg.data.max_length:
        problems.append(
            (
                ("draft", "max_position_embeddings"),
                f"{draft.max_position_embeddings} is below data.max_length {cfg.data.max_length}: "
                "training would place anchors at positions the draft does not support (and eval "
                "refuses them); raise it, leave it unset for the target's, or lower data.max_length",
            )
        )
    if shape is not None:
        if draft.mask_token_id >= shape.vocab_size:
            problems.append(
                (
                    ("draft", "mask_token_id"),
                    f"{draft.mask_token_id} is outside the target vocabulary "
                    f"(vocab_size {shape.vocab_size}); pick an existing, unused token id",
                    (("target", "shape", "vocab_size"), ("target", "model")),
                )
            )
        if draft.hidden_size != shape.hidden_size:
            problems.append(
                (
                    ("draft", "hidden_size"),
                    f"{draft.hidden_size} differs from the target's hidden_size "
                    f"{shape.hidden_size}; the draft uses the target's embedding and lm_head, "
                    "so they must match",
                    (("target", "shape", "hidden_size"), ("target", "model")),
                )
            )
        if draft.rope_theta is None and _rope_theta_known(cfg.target):
            draft.rope_theta = shape.rope_theta  # else None: splitserve.registry.rope_theta_problem
        # known from the target's config.json, target.shape or the registry; the section's
        # default is the target's own only for model: random, which is built from it
        positions_known = (cfg.target.model == "random"
                           or "max_position_embeddings" in shape.model_fields_set)
        if draft.max_position_embeddings is None and positions_known:
            draft.max_position_embeddings = shape.max_position_embeddings
        elif draft.max_position_embeddings is None:
            folder = Path(cfg.target.model).expanduser()
            config_json = folder / "config.json"
            serve = (f"the longest position the draft is to serve (at least data.max_length "
                     f"{cfg.data.max_length}; it becomes the export's max_position_embeddings and "
                     "bounds eval's prompts)")
            if not folder.exists():
                # A mistyped path read as a missing setting: the folder comes first. It is not
                # refused for itself: on several nodes it may be on the target's node alone.
                problems.append(
                    (
                        ("target", "model"),
                        f"no folder {cfg.target.model} on this machine (a typo? or the "
                        "target's folder on another node), so the target's "
                        "max_position_embeddings is not known here (target.shape does not declare "
                        "it) and draft.max_position_embeddings is not set: fix the path; for a "
                        "folder that is on the target's node only, set draft.max_position_embeddings "
                        f"to {serve}, or declare target.shape.max_position_embeddings",
                        (("draft", "max_position_embeddings"),),
                    )
                )
            else:
                why = (f"{config_json} gives none" if config_json.is_file()
                       else f"{config_json} cannot be read here")
                problems.append(
                    (
                        ("draft", "max_position_embeddings"),
                        f"not set, and the target's is not known ({why} and target.shape does not "
                        f"declare max_position_embeddings): set it to {serve}, or declare "
                        "target.shape.max_position_embeddings",
                    )
                )
        if positions_known and cfg.data.max_length > shape.max_position_embeddings:
            problems.append(
                (
                    ("data", "max_length"),
                    f"{cfg.data.max_length} is beyond the target's max_position_embeddings "
                    f"{shape.max_position_embeddings}: its features past that are not ones it "
                    "serves; lower data.max_length",
                    (("target", "shape", "max_position_embeddings"), ("target", "model")),
                )
            )

    if draft.head_dim is None:
        if draft.hidden_size % draft.num_attention_heads:
            problems.append(
                (
                    ("draft", "hidden_size"),
                    f"{draft.hidden_size} is not divisible by num_attention_heads "
                    f"{draft.num_attention_heads}; change one or set draft.head_dim",
                    (("draft", "num_attention_heads"),),
                )
            )
        else:
            draft.head_dim = draft.hidden_size // draft.num_attention_heads
    if draft.head_dim is not None and draft.head_dim % 2:
        problems.append(
            (
                ("draft", "head_dim"),
                f"{draft.head_dim} is odd (hidden_size / num_attention_heads unless set); RoPE "
                "rotates the two halves of each head, so it must be even",
                (("draft", "hidden_size"), ("draft", "num_attention_heads")),
            )
        )
    if draft.attention_backend == "flex":
        from draftforge.train.model import FLEX_MIN_HEAD_DIM

        if cfg.train.device == "cpu":
            problems.append(
                (
                    ("draft", "attention_backend"),
                    "flex cannot train with train.device: cpu (torch's flex attention has no "
                    "backward on the CPU); use draft.attention_backend: sdpa, or train on a GPU",
                )
            )
        elif draft.head_dim is not None and draft.head_dim < FLEX_MIN_HEAD_DIM:
            problems.append(
                (
                    ("draft", "attention_backend"),
                    f"flex needs draft.head_dim >= {FLEX_MIN_HEAD_DIM} (the minimum of its compiled "
                    f"CUDA kernel), this draft's is {draft.head_dim}; use draft.attention_backend: "
                    "sdpa or a larger head_dim",
                )
            )
    if draft.num_attention_heads % draft.num_key_value_heads:
        problems.append(
            (
                ("draft", "num_key_value_heads"),
                f"{draft.num_key_value_heads} does not divide num_attention_heads "
                f"{draft.num_attention_heads}",
                (("draft", "num_attention_heads"),),
            )
        )
    if (
        draft.markov_rank == 0
        and draft.enable_confidence_head
        and draft.confidence_head_with_markov
    ):
        problems.append(
            (
                ("draft", "markov_rank"),
                "0 disables the Markov head, but the confidence head is set to read the Markov "
                "embedding; set draft.confidence_head_with_markov: false, or "
                "draft.enable_confidence_head: false for the DFlash ablation",
            )
        )
    if cfg.train.markov_init == "bigram" and not draft.has_markov_table:
        problems.append(
            (
                ("train", "markov_init"),
                "bigram fills the Markov head's W1/W2 table, which needs draft.markov_rank > 0 "
                f"and a vanilla or gated head (this draft: rank {draft.markov_rank}, "
                f"{draft.markov_head_type}); set train.markov_init: random",
            )
        )
    if cfg.data.max_length > cfg.split.token_budget:
        problems.append(
            (
                ("split", "token_budget"),
                f"{cfg.split.token_budget} is less than data.max_length {cfg.data.max_length}: "
                "a sample that long would make a micro-batch over the budget on its own; raise "
                "split.token_budget or lower data.max_length",
                (("data", "max_length"),),
            )
        )
    if cfg.train.loss.ce_weight == 0 and cfg.train.loss.tv_weight == 0:
        problems.append(
            (
                ("train", "loss", "tv_weight"),
                "0 with ce_weight 0 as well: nothing would train the draft's predictions (the "
                "confidence head's BCE only fits the head); give either a positive weight",
            )
        )
    warmup = warmup_steps(cfg.train)
    if warmup >= cfg.train.steps:
        problems.append(
            (
                ("train", "warmup_ratio"),
                f"{cfg.train.warmup_ratio:g} of {cfg.train.steps} steps is {warmup} warmup steps, "
                "which leaves none for the cosine decay: the run would end at the peak learning "
                "rate; lower train.warmup_ratio or raise train.steps",
                (("train", "steps"),),
            )
        )
    if cfg.train.loss.position_weighting == "dpace" and cfg.train.grad_accum > 1:
        problems.append(
            (
                ("train", "grad_accum"),
                f"{cfg.train.grad_accum} micro-batches with train.loss.position_weighting: dpace: "
                "D-PACE weights depend on the draft's own acceptance, so the step's weight sum is "
                "known only after every micro-batch's forward, and each would be normalised "
                "alone; use position_weighting: exp, or a larger split.token_budget instead of "
                "accumulation",
            )
        )
    return problems


def _check_split(cfg: RecipeConfig) -> list[Problem]:
    """Derive trainer_ranks / world_size; check the split covers 0..world_size-1 exactly."""
    split = cfg.split
    problems: list[Problem] = []
    target = split.target_ranks
    for key, ranks in (("target_ranks", target), ("trainer_ranks", split.trainer_ranks or [])):
        negative = [r for r in ranks if r < 0]
        repeated = sorted({r for r in ranks if ranks.count(r) > 1})
        if negative:
            problems.append((("split", key), f"ranks must be >= 0, got {negative}"))
        if repeated:
            problems.append((("split", key), f"duplicate ranks {repeated}"))
    if not target:
        problems.append((("split", "target_ranks"), "the target group needs at least one rank"))
    if problems:
        return problems

    if split.trainer_ranks is None:
        world = split.world_size
        if world is None:  # one trainer rank, or one for each GPU trainer_devices names
            world = len(target) + (len(split.trainer_devices) if split.trainer_devices else 1)
        split.trainer_ranks = [r for r in range(world) if r not in target]
    if split.world_size is None:
        split.world_size = len(target) + len(split.trainer_ranks)
    if split.max_in_flight is None:
        # fewer credits than a step packs samples: the target cannot work ahead of the
        # trainer's step, and both wait in turn (an audit measured 20 % trainer idle)
        per_step = max(1, split.token_budget // cfg.data.max_length) * cfg.train.grad_accum
        producers = max(1, len(target) // split.target_tensor_parallel)
        split.max_in_flight = max(4, producers, 2 * per_step)
    trainer, world = split.trainer_ranks, split.world_size

    if not trainer:
        problems.append(
            (
                ("split", "trainer_ranks"),
                f"the trainer group is empty (world_size {world}, target_ranks {target}); "
                "raise split.world_size or list split.trainer_ranks",
            )
        )
    overlap = sorted(set(target) & set(trainer))
    if overlap:
        problems.append(
            (
                ("split", "trainer_ranks"),
                f"ranks {overlap} are in both target_ranks and trainer_ranks",
            )
        )
    covered = set(target) | set(trainer)
    if not overlap and covered != set(range(world)):
        missing = sorted(set(range(world)) - covered)
        extra = sorted(covered - set(range(world)))
        detail = []
        if missing:
            detail.append(f"ranks {missing} are in neither group")
        if extra:
            detail.append(f"ranks {extra} are >= world_size")
        problems.append(
            (
                ("split", "world_size"),
                f"{world}: target_ranks and trainer_ranks must together cover 0..{world - 1} "
                f"exactly ({'; '.join(detail)})",
            )
        )
    if not problems:
        from draftforge.splitserve.multinode import node_problems

        problems += node_problems(split)
    if len(target) % split.target_tensor_parallel:
        problems.append(
            (
                ("split", "target_tensor_parallel"),
                f"{split.target_tensor_parallel} does not divide the target group size {len(target)}",
            )
        )
    for key, ranks in (("target_devices", target), ("trainer_devices", trainer)):
        devices = getattr(split, key)
        if devices is not None and len(devices) != len(ranks):
            group = key.split("_")[0]
            problems.append(
                (
                    ("split", key),
                    f"lists {len(devices)} device(s) for {len(ranks)} {group} rank(s); give one per rank",
                )
            )
    return problems


def _check_data(cfg: RecipeConfig) -> list[Problem]:
    """Data settings that no sample could meet, or that training would ignore."""
    data = cfg.data
    problems: list[Problem] = []
    if data.min_loss_tokens >= data.max_length:
        problems.append(
            (
                ("data", "min_loss_tokens"),
                f"{data.min_loss_tokens} is not below data.max_length {data.max_length}: a sample "
                "also holds its prompt, so none would have that many supervised tokens and every "
                "one would be dropped; lower data.min_loss_tokens",
                (("data", "max_length"),),
            )
        )
    if data.regenerated_file is not None and not data.regenerate:
        problems.append(
            (
                ("data", "regenerated_file"),
                f"{data.regenerated_file} is read only with data.regenerate: true; with false the "
                "draft trains on the replies of data.train_files as they are and this file would "
                "be ignored: set data.regenerate: true to train on its answers, or remove it",
            )
        )
    return problems


def _cross_check(cfg: RecipeConfig) -> list[Problem]:
    shape, problems = _check_target(cfg)
    problems += _check_draft(cfg, shape)
    problems += _check_data(cfg)
    problems += _check_split(cfg)
    return problems


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
    shape the error messages. Raises :class:`RecipeError`.
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
        problems = [locator.line(*problem) for problem in _describe_all(exc.errors(), booleans)]
        raise RecipeError(problems) from None
    problems = [locator.line(*problem) for problem in _cross_check(cfg)]
    if problems:
        raise RecipeError(problems)
    cfg._locator = locator
    return cfg


def _string_keyed(data: Any) -> Any:
    """``data`` without the keys that are not strings (``1:``, ``~:``), at every depth."""
    if isinstance(data, dict):
        return {key: _string_keyed(value) for key, value in data.items() if isinstance(key, str)}
    if isinstance(data, list):
        return [_string_keyed(item) for item in data]
    return data


def load_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> RecipeConfig:
    """Load, override, validate and resolve the recipe at ``path``.

    Raises :class:`RecipeError` listing every problem, each naming the file and
    line (or the override) and the key path.
    """
    path = Path(path)
    source = str(path)
    if not path.exists():
        raise RecipeError([f"{source}: no such recipe file"])
    if path.is_dir():
        raise RecipeError([f"{source}: is a directory, expected a recipe .yaml file"])
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
