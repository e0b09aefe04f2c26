"""The commands quoted in PERFORMANCE.md, RESULTS.md and the recipes' comments still run.

Every ``section.key`` they quote is a recipe key, every ``--option`` of a quoted
``draftforge`` command is one of that command's options, every recipe they name
exists, and every quoted command's overrides load with its recipe. A renamed key
or option fails here instead of in a reader's shell.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

from draftforge import cli
from draftforge.config import RecipeConfig, load_recipe
from draftforge.reference import walk

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("PERFORMANCE.md", "RESULTS.md")
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))

SECTIONS = "target|draft|data|split|train|eval|export"
# a dotted recipe key followed by '=' (an override), ':' (a YAML line) or a closing backtick
KEY = re.compile(rf"(?<![\w./-])((?:{SECTIONS})(?:\.[a-z_]+)+)(?=\s*[=:`])")
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)


def comments(recipe: Path) -> str:
    lines = recipe.read_text().splitlines()
    return "\n".join(line.split("#", 1)[1] for line in lines if "#" in line)


def quoted_commands(text: str) -> list[str]:
    """``draftforge ...`` spans in backticks (joined across lines) and in code blocks."""
    commands = []
    for block in FENCE.findall(text):
        lines = (line.lstrip("$ ") for line in block.splitlines())
        commands += [line for line in lines if line.startswith("draftforge ")]
    for span in re.findall(r"`([^`]+)`", FENCE.sub("", text)):
        span = " ".join(span.split())
        if span.startswith("draftforge "):
            commands.append(span)
    return commands


def comment_commands(text: str) -> list[str]:
    """``draftforge ...`` in recipe comments: the rest of the line, up to prose."""
    found = []
    for line in text.splitlines():
        if "draftforge " in line:
            rest = "draftforge " + line.split("draftforge ", 1)[1]
            found.append(re.split(r"[`'(:]|\s{2}", rest)[0].strip())
    return found


def unknown_keys(text: str) -> list[str]:
    keys = {key for key, _ in walk(RecipeConfig)}
    return sorted({key for key in KEY.findall(text) if key not in keys})


def command_of(line: str) -> cli.Command | None:
    argv = line.split()[1:]
    matches = [c for c in cli.COMMANDS if tuple(argv[: len(c.words)]) == c.words]
    return max(matches, key=lambda c: len(c.words)) if matches else None


@cache
def help_text(command: cli.Command) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main([*command.words, "--help"])
    return out.getvalue()


def unknown_options(lines: list[str]) -> list[str]:
    bad = []
    for line in lines:
        command = command_of(line)
        if command is None:
            bad.append(f"{line!r}: no such command")
            continue
        for option in OPTION.findall(line):
            if not re.search(rf"(?<![\w-]){option}(?![\w-])", help_text(command)):
                bad.append(f"{line!r}: {command.name} has no option {option}")
    return bad


def overrides_and_recipe(line: str) -> tuple[str | None, list[str]]:
    """The recipe a command names and its ``key=value`` overrides, placeholders left out."""
    line = re.sub(r"<[^>]*>", "X", line)  # data.regenerated_file=<the float32 demo's answers>
    words = shlex.split(line)
    recipe = next((w for w in words if re.fullmatch(r"recipes/[\w.-]+\.yaml", w)), None)
    overrides = [
        w for w in words
        if re.match(rf"(?:{SECTIONS})\.[a-z_.]+=", w)
        # placeholders: a one-letter value (B, N, R) or an elided list
        and not re.fullmatch(r"[A-Z]|\[\.\.\.\]", w.split("=", 1)[1])
    ]
    return recipe, overrides


def test_the_checks_catch_a_renamed_key_or_option():
    # what a rename would leave behind in the docs
    assert unknown_keys("`draftforge train R train.lossy.decay=1` and `split.budget`") == [
        "split.budget", "train.lossy.decay",
    ]
    assert unknown_keys("`train.loss.decay=1.0` and `target.generation.batch_size: 32`") == []
    assert unknown_options(["draftforge eval RUN --num-prompt 8 --no-estimate"]) == [
        "'draftforge eval RUN --num-prompt 8 --no-estimate': eval has no option --num-prompt",
    ]
    assert unknown_options(["draftforge eval compare A B --a-method ngram"]) == []
    assert overrides_and_recipe(
        "draftforge data regenerate recipes/x.yaml target.generation.batch_size=B"
        " data.regenerated_file=ANSWERS"
    ) == ("recipes/x.yaml", ["data.regenerated_file=ANSWERS"])


@pytest.mark.parametrize("doc", [*DOCS, *(p.relative_to(ROOT).as_posix() for p in RECIPES)])
def test_quoted_keys_exist(doc):
    path = ROOT / doc
    text = comments(path) if path.suffix == ".yaml" else path.read_text()
    assert unknown_keys(text) == [], f"{doc} quotes recipe keys that do not exist"


@pytest.mark.parametrize("doc", DOCS)
def test_quoted_commands_have_their_options(doc):
    lines = quoted_commands((ROOT / doc).read_text())
    assert len(lines) > 20  # the extraction found the commands
    assert unknown_options(lines) == []


def test_recipe_comment_commands_have_their_options():
    lines = [line for recipe in RECIPES for line in comment_commands(comments(recipe))]
    assert any("--master-addr" in line for line in lines)
    assert unknown_options([line for line in lines if command_of(line) is not None]) == []


@pytest.mark.parametrize("doc", DOCS)
def test_quoted_commands_load_with_their_overrides(doc, monkeypatch):
    monkeypatch.chdir(ROOT)  # the commands name recipes relative to the repository root
    checked = 0
    for line in quoted_commands((ROOT / doc).read_text()):
        recipe, overrides = overrides_and_recipe(line)
        if recipe is None:
            continue
        assert (ROOT / recipe).is_file(), f"{doc}: {line!r} names a recipe that does not exist"
        load_recipe(recipe, overrides)
        checked += bool(overrides)
    assert checked >= 5
