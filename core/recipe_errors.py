"""Recipe errors: :class:`RecipeError`, and pydantic's validation errors turned into messages
located at the key path, the file's line or the override that set the value (``_Locator``)."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from pydantic import BaseModel

from draftforge.errors import InputError

KeyPath = tuple[str | int, ...]


class RecipeError(InputError):
    """A recipe (or an override of it) is invalid.

    ``problems`` holds one line per problem; ``str(error)`` joins them.
    """

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


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


def _walk(loc: Sequence[str | int], root: type[BaseModel]) -> tuple[KeyPath, Any]:
    """Follow a pydantic error location through the models, from ``root`` (the recipe's).

    Returns the key path (union/member tags dropped) and the annotation that the
    last element refers to (a model class, a Literal, ...), or None.
    """
    path: list[str | int] = []
    current: Any = root
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


def _model_at(path: KeyPath, root: type[BaseModel]) -> type[BaseModel] | None:
    _, annotation = _walk(path, root)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


NONE_IS_A_STRING = "unquoted None is the string 'None' in YAML, not null; write null (or ~) for none"
# how _index_lines and parse_override record an override whose value is blank ('key=')
BLANK_VALUE = ""


def _nullable(path: KeyPath, root: type[BaseModel]) -> bool:
    """Whether the key at ``path`` takes null (its field is ``X | None``)."""
    model = _model_at(path[:-1], root) if path and isinstance(path[-1], str) else None
    field = model.model_fields.get(path[-1]) if model is not None else None
    return field is not None and type(None) in typing.get_args(field.annotation)


def _non_ascii_note(key: str) -> str:
    """For a key holding characters outside ASCII (every valid key is ASCII), which ones: a
    Cyrillic 'а' or a Greek 'ο' pasted into 'train' looks like the valid key it is not."""
    import unicodedata

    odd = [(i, c) for i, c in enumerate(key) if not c.isascii()]
    if not odd:
        return ""
    named = ", ".join(f"{c!r} at position {i + 1} is {unicodedata.name(c, 'unnamed')} (U+{ord(c):04X})"
                      for i, c in odd[:3])
    return f"; it holds characters that are not ASCII, which no key has: {named}"


def shell_quoted(path: KeyPath, spelled: str) -> str:
    """The override that gives ``path`` the string ``spelled`` in a shell, whose own quotes
    would strip a bare pair: ``train.output_dir='"yes"'`` (single quotes around YAML's double)."""
    return f"{_dotted(path)}='\"{spelled}\"'"


def quote_advice(path: KeyPath, spelled: str, overridden: bool) -> str:
    """What follows "quote it" so that YAML reads ``spelled`` as a string: ``: 'yes'`` in the
    file; the shell form where an override gave it (``'yes'`` on a command line loses its
    quotes): ``, in a shell: train.output_dir='"yes"'``."""
    return f", in a shell: {shell_quoted(path, spelled)}" if overridden else f": {spelled!r}"


def _describe(
    error: dict[str, Any], booleans: dict[KeyPath, str], root: type[BaseModel],
    overridden: Iterable[KeyPath] = (),
) -> tuple[KeyPath, str]:
    """A pydantic error as (key path, problem text); ``booleans`` as _index_lines records them,
    ``root`` the model validated (the recipe's), ``overridden`` the key paths an override set
    (quoting advice for them is the shell's)."""
    loc = tuple(error["loc"])
    kind = error["type"]
    value = error.get("input")
    if kind == "extra_forbidden":
        path, _ = _walk(loc, root)
        model = _model_at(path[:-1], root) if path else None
        valid = sorted(model.model_fields) if model is not None else []
        key = str(path[-1]) if path else "?"
        hint = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
        return path, f"unknown key{did_you_mean}{_non_ascii_note(key)}; valid keys: {', '.join(valid)}"
    path, annotation = _walk(loc, root)
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
            advice = quote_advice(path, spelled, path in set(overridden))
            hint = f" (unquoted {spelled} is a boolean in YAML; quote it{advice})"
        elif value == "None" and booleans.get(path) == "None" and _nullable(path, root):
            hint = f" ({NONE_IS_A_STRING})"
        elif value is None and booleans.get(path) == BLANK_VALUE:
            hint = " (nothing follows '=' in the override, and YAML reads a blank value as null)"
        return path, f"expected {_EXPECTED[kind]}, got {_show(value)}{hint}"
    if kind in ("too_short", "too_long"):  # pydantic: "List should have at least 1 item after validation, not 0"
        ctx = error.get("ctx", {})
        bound = ctx.get("min_length") if kind == "too_short" else ctx.get("max_length")
        items = f"{bound} item{'' if bound == 1 else 's'}"
        return path, f"must hold {'at least' if kind == 'too_short' else 'at most'} {items}, got {_show(value)}"
    message = str(error.get("msg", kind))
    if message.startswith("Value error, "):
        return path, message[len("Value error, ") :]
    message = message.replace("Input should be", "must be")
    return path, f"{message}, got {_show(value)}"


def _describe_all(
    errors: Sequence[dict[str, Any]], booleans: dict[KeyPath, str], root: type[BaseModel],
    overridden: Iterable[KeyPath] = (),
) -> list[tuple[KeyPath, str]]:
    """Every pydantic error as (key path, problem text); a value that fits no member of a union
    (``train.loss.compile``: a bool or 'auto') is one problem naming every member, not one
    contradicting problem per member (their locations end in a member tag)."""
    out: list[tuple[KeyPath, str]] = []
    members: dict[KeyPath, tuple[int, list[str], Any]] = {}  # path: (index in out, expected, value)
    for error in errors:
        loc = tuple(error["loc"])
        path, _ = _walk(loc, root)
        if path == loc:
            out.append(_describe(error, booleans, root, overridden))
            continue
        kind = error["type"]
        if kind == "literal_error":
            expected = str(error.get("ctx", {}).get("expected", "?"))
        elif kind == "finite_number":  # the float member of int | float, given .inf or .nan
            expected = "a finite number"
        else:
            expected = _EXPECTED.get(kind) or _describe(error, booleans, root, overridden)[1]
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
        found = [self.where(other) for other in related if self.given(other)]
        override = next((w for w in found if w.startswith("command line")), None)
        if not self.given(path):
            return override or (found[0] if found else where)
        if where.startswith("command line"):
            return where
        # the file's line alone hides what brought the problem about: a related override, or
        # one of a key inside the section the problem is of (target.model=random, where the
        # file's target section has no shape)
        withs = [override.removeprefix("command line ")] if override is not None else []
        withs += [repr(text) for inner, text in self.overrides.items()
                  if len(inner) > len(path) >= 1 and inner[: len(path)] == path]
        withs = list(dict.fromkeys(withs))
        if withs:
            where = f"{where} (with command line {' and '.join(withs)})"
        return where
