"""README.md against the code: the commands, options, keys and make targets it quotes exist.

tests/test_docs_r10.py holds PERFORMANCE.md, RESULTS.md and the recipes' comments to the
CLI and the recipe schema; this holds README.md to them too, and checks what only README
states: its Commands table covers every ``draftforge`` command, its recipe-error example is
what ``config show`` prints, its make targets and variables are the Makefile's, and every
benchmark's help gives its defaults, as README says.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from test_docs_r10 import command_of, help_text, overrides_and_recipe, quoted_commands, unknown_keys

from draftforge import cli
from draftforge.config import load_recipe

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
# the recipe-error example misspells a key on purpose
MISSPELT = "draft.markov_rnk"
# `draftforge ...` spans that are not one command line: an error's heading, the bench group,
# placeholders for a command, the version flag
NOT_A_COMMAND = (
    "draftforge config show: invalid recipe:",
    "draftforge bench objective|target|train|peer|split",
    "draftforge bench NAME --help",
    "draftforge help COMMAND",
    "draftforge --version",
)


def readme_commands() -> list[str]:
    return [line.replace("\\|", "|") for line in quoted_commands(README)]


def table_rows() -> list[str]:
    """The first cell of each row of README's Commands table."""
    section = README.split("\n## Commands\n", 1)[1].split("\n\n", 1)[0]
    return [row.split("` |", 1)[0].removeprefix("| `") for row in section.splitlines()
            if row.startswith("| `draftforge")]


def test_every_quoted_command_exists_and_has_the_options_readme_gives_it():
    lines = readme_commands()
    assert len(lines) > 40  # the extraction found the commands
    odd = sorted({line for line in lines if command_of(line) is None})
    assert odd == sorted(NOT_A_COMMAND), "README quotes a draftforge command that does not exist"
    bad = [
        f"{line!r}: {command_of(line).name} has no option {option}"
        for line in lines if command_of(line) is not None
        for option in OPTION.findall(line)
        if not re.search(rf"(?<![\w-]){option}(?![\w-])", help_text(command_of(line)))
    ]
    assert bad == []


def test_the_commands_table_covers_every_command():
    rows = table_rows()
    named = {command_of(row.replace("\\|", "|")) for row in rows} - {None}
    bench_row = next(row for row in rows if row.startswith("draftforge bench "))
    benches = set(bench_row.removeprefix("draftforge bench ").split("\\|"))
    missing = [c.name for c in cli.COMMANDS
               if c not in named and not (c.words[0] == "bench" and c.words[1] in benches)]
    assert missing == [], "commands the README's Commands table does not name"
    assert benches == {c.words[1] for c in cli.COMMANDS if c.words[0] == "bench"}


def test_version_and_help_spans_work():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["--version"]) == 0
    assert out.getvalue().startswith("draftforge ")
    assert help_text(cli.COMMANDS[0])  # `draftforge help COMMAND` is `COMMAND --help`
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli.main(["help", *cli.COMMANDS[0].words])
    assert out.getvalue() == help_text(cli.COMMANDS[0])


def test_quoted_recipe_keys_exist():
    assert unknown_keys(README) == [MISSPELT]


def test_quoted_commands_load_with_their_overrides(monkeypatch):
    monkeypatch.chdir(ROOT)
    checked = 0
    for line in readme_commands():
        recipe, overrides = overrides_and_recipe(line)
        if recipe is None or MISSPELT in line:
            continue
        assert (ROOT / recipe).is_file(), f"{line!r} names a recipe that does not exist"
        load_recipe(recipe, overrides)
        checked += 1
    assert checked >= 4


def test_the_recipe_error_example_is_what_config_show_prints(capsys):
    block = re.search(r"```text\n\$ (draftforge config show [^\n]+)\n(.*?)```", README, re.S)
    assert block, "README's recipe-error example is gone"
    argv = block.group(1).split()[1:]
    assert cli.main(argv) == 2
    printed = capsys.readouterr().err.splitlines()
    shown = block.group(2).splitlines()
    assert len(printed) == len(shown)
    for got, quoted in zip(printed, shown, strict=True):
        # README elides the long list of valid keys with "..."
        head = quoted.removesuffix("...")
        assert got == quoted or (quoted.endswith("...") and got.startswith(head)), (got, quoted)


def test_make_targets_and_variables_readme_names_exist():
    targets = set(re.findall(r"^([a-z][a-z-]*):", MAKEFILE, re.M))
    variables = set(re.findall(r"^([A-Z_]+) *[?:]?=", MAKEFILE, re.M))
    uses = re.findall(r"make ([a-z][a-z-]*)((?: [A-Z_]+=[^` ]*)*)", README)
    assert len(uses) > 10
    for target, assigns in uses:
        assert target in targets, f"README names make {target}, which the Makefile lacks"
        for name in re.findall(r"([A-Z_]+)=", assigns):
            assert name in variables, f"README sets {name} for make {target}; the Makefile has no such variable"
    named = set(re.findall(r"`([A-Z_]+_(?:ARGS|EXPORT|RECIPE))[`=]", README)) - {"DRAFTFORGE_SGLANG_EXPORT"}
    assert named and named <= variables, sorted(named - variables)


def test_bench_peer_help_gives_each_options_default():
    """README says each benchmark's --help lists its defaults; bench peer's left them out."""
    from draftforge.train.bench_peer import _parser

    assert "lists each one's options and defaults" in README
    for action in _parser()._actions:
        if action.default in (None, False) or not action.option_strings or action.dest == "help":
            continue
        assert f"default {action.default}" in (action.help or ""), action.option_strings
