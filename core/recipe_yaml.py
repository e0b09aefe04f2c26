"""Recipe YAML: reading a recipe with the line of every key path (and how each unquoted
boolean was written), ``key.sub=value`` overrides, and the dumper that writes a resolved recipe."""

from __future__ import annotations

import re
from typing import Any

import yaml

from draftforge.recipe_errors import BLANK_VALUE, KeyPath, RecipeError, _dotted


class _RecipeDumper(yaml.SafeDumper):
    """Block-style mappings, with lists of plain values on one line (``[0, 1, 2]``)."""


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    flat = all(not isinstance(item, (dict, list)) for item in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


_RecipeDumper.add_representer(list, _represent_list)


# --------------------------------------------------------------------------- YAML


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4`` as a float (YAML 1.1 wants ``1.0e-4``), and reads
    ``1:30`` and ``0b11`` as the strings YAML 1.2 reads, not 1.1's base-60 and binary numbers.
    It also keeps where each alias (``*name``) was used: the composed tree shares the anchored
    node itself, which knows only where the anchor is."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        # id(node) -> (mark, anchor) of each use of that node through an alias, in the text's order
        self.alias_uses: dict[int, list[tuple[yaml.Mark, str]]] = {}

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        alias = self.peek_event() if self.check_event(yaml.AliasEvent) else None
        node = super().compose_node(parent, index)
        if alias is not None:
            self.alias_uses.setdefault(id(node), []).append((alias.start_mark, alias.anchor))
        return node

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
_INT = re.compile(r"^(?:[-+]?0[0-9_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$")
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
# the writer knows the reader's rules too: a string that the loader would read as something
# else ('1e5' a float, '0815' and '0_8' ints) is written quoted, so that it loads back a string.
# The writer's own (YAML 1.1) rules stay first, so that it still writes an int or float plain.
for _first, _resolvers in _RecipeLoader.yaml_implicit_resolvers.items():
    for _tag, _regexp in _resolvers:
        if (_tag, _regexp) not in _RecipeDumper.yaml_implicit_resolvers.get(_first, []):
            _RecipeDumper.add_implicit_resolver(_tag, _regexp, [_first])
del _first, _resolvers, _tag, _regexp
# and the string 'None' is written quoted: unquoted, a nullable key refuses it (validate_recipe)
_RecipeDumper.add_implicit_resolver("tag:yaml.org,2002:null", re.compile(r"^None$"), ["N"])


# the line breaks YAML reads (a CR LF pair is one), as PyYAML's marks count them
_LINE_BREAK = re.compile("\r\n|[\r\n\x85\u2028\u2029]")


def _line_column(text: str, position: int) -> tuple[int, int]:
    """The 1-based line and column of the character at ``position`` in ``text``, as YAML counts
    them: every YAML line break (CR only, CR LF, LF, NEL, U+2028, U+2029) ends a line, and a
    byte-order mark at the start is no column."""
    breaks = list(_LINE_BREAK.finditer(text, 0, position))
    if breaks:
        start = breaks[-1].end()
    else:
        start = 1 if text.startswith("\ufeff") and position > 0 else 0
    return len(breaks) + 1, position - start + 1


def _yaml_hint(text: str, exc: yaml.MarkedYAMLError, mark) -> str:
    """What a YAML syntax error usually means, where PyYAML's words do not say it: a tab (YAML
    indents with spaces), or an invisible non-breaking space on the line (read as part of a
    word, so 'key:\u00a0value' is no key)."""
    hints = []
    lines = text.splitlines()
    tab = exc.problem_mark
    if "'\\t'" in (exc.problem or "") and tab is not None:
        line = lines[tab.line] if tab.line < len(lines) else ""
        if tab.line == 0 and line.startswith("\ufeff"):
            line = line[1:]  # PyYAML's columns do not count a byte-order mark
        if line[: tab.column].strip(" \t"):  # after the line's first character: no indentation
            hints.append(f"a tab at column {tab.column + 1}; use spaces")
        else:
            hints.append(f"a tab at column {tab.column + 1}: YAML indents with spaces, not tabs")
    if mark is None or mark.line >= len(lines):
        return f" ({'; '.join(hints)})" if hints else ""
    before = next((n for n in range(mark.line - 1, -1, -1) if lines[n].strip()
                   and not lines[n].lstrip().startswith("#")), None)
    if (exc.problem == "mapping values are not allowed here" and before is not None
            and ":" not in lines[before].split("#")[0].replace(":\u00a0", "")):
        # 'steps=20' above a key: a plain text that YAML continues onto this line
        hints.append(f"line {before + 1} ({lines[before].strip()!r}) is no 'key: value' pair, so YAML "
                     "reads it as text going on into this line")
    for n in dict.fromkeys([mark.line, *([before] if before is not None else [])]):
        if "\u00a0" in lines[n]:
            hints.append(f"line {n + 1} holds a non-breaking space (U+00A0) at column "
                         f"{lines[n].index(chr(0xa0)) + 1}, which YAML does not read as a space: "
                         "type a plain space")
    return f" ({'; '.join(hints)})" if hints else ""


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
        _refuse_expansion(node, loader, source)
        if node is not None:
            # before constructing: construction flattens merge keys (<<: *anchor) into the
            # mapping, and an explicit key beside a merged one would look duplicated
            _index_lines(node, (), lines, problems, source, booleans)
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        if exc.context == "while scanning a simple key" and exc.context_mark is not None:
            mark = exc.context_mark  # the line holding the key (PyYAML notices on the next one)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        context = exc.context
        if context and exc.context_mark is not None and mark is not exc.context_mark \
                and exc.context_mark.line != mark.line:  # an unclosed quote: where it opened
            context = f"{context} (line {exc.context_mark.line + 1})"
        problem = ": ".join(p for p in (context, exc.problem) if p)
        raise RecipeError([f"{where}: YAML syntax error: {problem}{_yaml_hint(text, exc, mark)}"]) from None
    except yaml.YAMLError as exc:
        raise RecipeError([f"{source}: YAML syntax error: {exc}"]) from None
    except RecursionError:  # hundreds of nested [ or { (the parser recurses once a level)
        raise RecipeError([f"{source}: nesting too deep: a recipe's values are a few levels of "
                           "sections, lists and mappings"]) from None
    finally:
        loader.dispose()
    return data, lines, booleans, problems


def read_yaml(text: str, source: str) -> Any:
    """YAML that a run wrote and draftforge reads back (a run's ``config.yaml``, a
    checkpoint's ``recipe.yaml``), read as a recipe is: aliases that cycle or expand it past
    :data:`MAX_EXPANDED_VALUES` values are refused, so a crafted run folder cannot make a
    resume hang. Raises :class:`RecipeError` naming ``source``."""
    return _parse_yaml(text, source)[0]


def _children(node: yaml.Node) -> list[yaml.Node]:
    """A node's keys and values (a mapping's), items (a sequence's), or nothing (a scalar's)."""
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return node.value if isinstance(node, yaml.SequenceNode) else []


def _cycle(node: yaml.Node, inside: set[int] | None = None, done: set[int] | None = None) -> yaml.Node | None:
    """The first node that contains itself through an alias (``a: &x [*x]``), or None: a
    recipe is a tree, and walking such a node would never end. A node shared through aliases
    is walked once (``done``): walking it at every use took time that grows with each level
    of aliases of aliases."""
    inside = set() if inside is None else inside
    done = set() if done is None else done
    if id(node) in inside:
        return node
    if id(node) in done:
        return None
    inside.add(id(node))
    found = next((found for child in _children(node) if (found := _cycle(child, inside, done)) is not None),
                 None)
    inside.discard(id(node))
    done.add(id(node))
    return found


def _refuse_cycle(node: yaml.Node | None, where: str, *, line: bool = True) -> None:
    found = _cycle(node) if node is not None else None
    if found is not None:
        at = f"{where}:{found.start_mark.line + 1}" if line else where
        raise RecipeError([f"{at}: YAML syntax error: an alias (*name) refers to a value that "
                           "contains it; a recipe is a tree, not a cycle"])


# the most values a recipe may hold once its aliases are expanded: a recipe holds a few hundred,
# and a few lines of aliases of aliases ('x1: &b [*a, *a, ...]') can stand for billions
MAX_EXPANDED_VALUES = 100_000


def _refuse_expansion(node: yaml.Node | None, loader: _RecipeLoader, where: str, *, line: bool = True) -> None:
    """Refuse a tree (without cycles: _refuse_cycle) whose aliases expand it past
    MAX_EXPANDED_VALUES nodes, naming the alias (``*name``) that passes it. Each node's
    expanded size is counted once, so the count takes time in the size of the text."""
    if node is None:
        return
    sizes: dict[int, int] = {}  # id(node) -> its expanded size, once walked
    uses: dict[int, int] = {}  # id(node) -> how many of its alias uses the walk has passed
    total = 0

    def walk(node: yaml.Node) -> int:
        nonlocal total
        key = id(node)
        if key in sizes:  # a use through an alias: the text walked so far is its anchor's
            number = uses.get(key, 0)
            uses[key] = number + 1
            total += sizes[key]
            if total > MAX_EXPANDED_VALUES:
                recorded = loader.alias_uses.get(key, [])
                mark, anchor = recorded[number] if number < len(recorded) else (node.start_mark, "")
                at = f"{where}:{mark.line + 1}" if line else where
                alias = f"the alias *{anchor}" if anchor else "an alias"
                raise RecipeError([f"{at}: {alias} takes the recipe past {MAX_EXPANDED_VALUES} values "
                                   "once its aliases are expanded (each alias repeats its anchor's "
                                   "values, and an alias of aliases multiplies them); a recipe holds "
                                   "a few hundred: use fewer aliases (*name) or write the values out"])
            return sizes[key]
        total += 1
        size = 1 + sum(walk(child) for child in _children(node))
        sizes[key] = size
        return size

    walk(node)


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
    wanted a string, and each unquoted ``None`` (a string in YAML, not null); report duplicate
    and non-string keys, led by ``source:line`` (nothing for a value given on the command line,
    whose caller says where).
    A key that a merge (``<<: *anchor``) brings in is at the line of that merge: the anchor's
    own lines are shared by every mapping that merges it."""
    at = (lambda line: f"{source}:{line}: ") if source is not None else (lambda line: "")
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        values: dict[str, yaml.Node] = {}  # each key's value node, for the lines a duplicate drops
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
                # the lines of the first value's keys, which YAML dropped (the paths that value
                # gives, not a search of every line: that took time in lines x duplicates)
                for stale in _key_paths(values[key], path + (key,)):
                    lines.pop(stale, None)
            else:
                seen[key] = line
            values[key] = value_node
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
    elif node.tag == "tag:yaml.org,2002:str" and node.style is None and node.value == "None":
        booleans[path] = node.value  # Python's None, which YAML reads as the string 'None'


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
            _refuse_expansion(node, loader, where, line=False)
            if node is not None:  # duplicate and non-string keys, as in a file
                _index_lines(node, parts, {}, problems, None, {} if booleans is None else booleans)
            value = loader.construct_document(node) if node is not None else None
            if node is None and booleans is not None:  # 'key=' or 'key=  ': YAML reads null
                booleans[parts] = BLANK_VALUE
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        raise RecipeError([f"{where}: value is not valid YAML: {problem}"]) from None
    except RecursionError:
        raise RecipeError([f"{where}: value nested too deep"]) from None
    if problems:
        raise RecipeError([f"{where}: {problem}" for problem in problems])
    comment = _comment_start(raw)
    if comment is not None:  # YAML drops it: 'output_dir=runs/exp #2' would be runs/exp
        raise RecipeError([
            f"{where}: the value's {raw[comment:].strip()!r} reads as a YAML comment and would be "
            f"dropped, leaving {raw[:comment].strip()!r}; quote the text that holds the '#' to keep "
            f"it (in a shell: {'.'.join(parts)}='\"{raw.strip()}\"'), or leave the comment out"])
    return parts, value


def _comment_start(raw: str) -> int | None:
    """Where a YAML comment starts in an override's value text (which parsed), or None: the
    scanner skips comments, so one is text after the last token's end."""
    end = 0
    for token in yaml.scan(raw, Loader=_RecipeLoader):
        if not isinstance(token, yaml.StreamEndToken):
            end = max(end, token.end_mark.index)
    rest = raw[end:]
    return end + rest.index("#") if "#" in rest else None


def _apply_override(
    data: dict[str, Any], text: str, booleans: dict[KeyPath, str]
) -> tuple[tuple[str, ...], list[KeyPath]]:
    """Set one override in the raw tree (before validation); return its key path and the key
    paths it gives a value: that path, or for a mapping merged into a section only the keys
    the mapping lists (the section's other keys are still where the recipe set them).
    ``booleans`` (the file's spellings, see _index_lines) loses what it recorded under every
    path the override sets, and gets the override's own: a quoted 'None' on the command line
    is no unquoted None, whatever the file wrote there."""
    own: dict[KeyPath, str] = {}
    parts, value = parse_override(text, own)
    sets = _set_override(data, text, parts, value)
    for stale in [path for path in booleans if any(path[: len(set_)] == set_ for set_ in sets)]:
        del booleans[stale]
    booleans.update(own)
    return parts, sets


def _set_override(data: dict[str, Any], text: str, parts: tuple[str, ...], value: Any) -> list[KeyPath]:
    """Set ``parts`` to ``value`` in the raw tree; the key paths it gives a value (_apply_override)."""
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
        return [parts + leaf for leaf in _leaves(value)]
    node[parts[-1]] = value
    return [parts]


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
