"""README's Commands table documents every option of every command.

tests/test_docs_r20.py checks that what README quotes exists (every option it names is one
of its command's); this checks the other direction: every option a command's ``--help``
lists is named in a row of the Commands table for that command, each command has a row of
its own (each benchmark too, not only the ``bench objective|target|...`` group row), the
numeric defaults ``--help`` states are in that command's rows, and the keys of each
machine-readable last line a row quotes are the ones its command's code prints.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from test_docs_r10 import command_of, help_text

from draftforge import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
# "(default 600 s ...)", "(default: 10000; ...)": the first word of a stated default
DEFAULT = re.compile(r"default:? ([\w.,/$~-]+)")
# a stated default that is prose, not a value ("default: the recipe's ...")
PROSE = {"the", "a", "an", "one", "that", "follows", "all", "both"}


def commands_table(readme: str) -> dict[cli.Command, list[tuple[str, str]]]:
    """Each command's rows of README's Commands table: (synopsis, description)."""
    section = readme.split("\n## Commands\n", 1)[1].split("\n\n", 1)[0]
    rows: dict[cli.Command, list[tuple[str, str]]] = {}
    for row in section.splitlines():
        if not row.startswith("| `draftforge"):
            continue
        synopsis, description = row.removeprefix("| `").split("` |", 1)
        synopsis = synopsis.replace("\\|", "|")
        command = command_of(synopsis)
        if command is not None:
            rows.setdefault(command, []).append((synopsis, description.replace("\\|", "|")))
    return rows


def options_of(command: cli.Command) -> list[str]:
    """The options ``--help`` lists for a command (its usage lines; suppressed ones are not)."""
    usage = help_text(command).split("\n\n", 1)[0]
    return sorted(set(OPTION.findall(usage)) - {"--help"})


def stated_defaults(command: cli.Command) -> list[tuple[str, str]]:
    """(option, value) for each default a command's ``--help`` states as a value."""
    body = help_text(command).split("\noptions:\n", 1)[-1]
    found = []
    for entry in re.finditer(r"\n  (?:-\w, )?(--[a-z0-9-]+)[^\n]*(?:\n {6,}[^\n]*)*", "\n" + body):
        text = " ".join(entry.group(0).split())
        for value in DEFAULT.findall(text):
            value = value.rstrip(".,;")
            if value.lower() not in PROSE:
                found.append((entry.group(1), value))
    return found


def _mentions(option: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def _plain(text: str) -> str:
    """Thousands separators dropped (README writes 10,000 where --help may write 10000)."""
    return re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)


def undocumented_options(readme: str) -> list[str]:
    table = commands_table(readme)
    missing = []
    for command in cli.COMMANDS:
        rows = table.get(command, [])
        if not rows:
            missing.append(f"{command.name}: no row of its own in the Commands table")
            continue
        synopses = " ".join(synopsis for synopsis, _ in rows)
        missing += [f"{command.name} {option}" for option in options_of(command)
                    if not _mentions(option, synopses)]
    return missing


def missing_defaults(readme: str) -> list[str]:
    table = commands_table(readme)
    missing = []
    for command in cli.COMMANDS:
        described = _plain(" ".join(description for _, description in table.get(command, [])))
        missing += [f"{command.name} {option}: default {value}" for option, value in stated_defaults(command)
                    if _plain(value) not in described]
    return missing


def _printed_by(command: cli.Command, key: str) -> bool:
    source = Path(importlib.util.find_spec(command.handler.split(":")[0]).origin).read_text()
    if re.search(rf"(?<!\w){key}=", source):
        return True
    # draftforge eval prints al_<method>= for each method in a loop
    return key.startswith("al_") and "al_{" in source and f'"{key[3:]}"' in source


def wrong_last_lines(readme: str) -> list[str]:
    wrong = []
    for command, rows in commands_table(readme).items():
        for _, description in rows:
            for line in re.findall(r"[Tt]he last line is `([^`]+)`", description):
                wrong += [f"{command.name}: {key}=" for key in re.findall(r"(\w+)=", line)
                          if not _printed_by(command, key)]
    return wrong


def test_every_option_of_every_command_is_in_its_commands_table_row():
    table = commands_table(README)
    assert {c.words[0] for c in table} >= {"bench", "eval", "train", "export", "demo", "data", "config"}
    assert sum(map(len, (options_of(c) for c in cli.COMMANDS))) > 80  # the options were found
    assert undocumented_options(README) == []


def test_the_defaults_help_states_are_in_the_commands_table():
    assert len([d for c in cli.COMMANDS for d in stated_defaults(c)]) > 30
    assert missing_defaults(README) == []


def test_the_last_lines_the_table_quotes_are_printed_by_their_command():
    quoted = [c for c, rows in commands_table(README).items()
              for _, d in rows if re.search(r"[Tt]he last line is `", d)]
    assert len(quoted) >= 7  # eval, export, demo and the five benchmarks
    assert wrong_last_lines(README) == []


def test_the_checks_fail_when_readme_loses_an_option_or_a_default():
    # an option left out of its row's synopsis (it is still named in the description)
    lost = README.replace("[--interleave]`", "`", 1)
    assert lost != README
    assert undocumented_options(lost) == ["bench peer --interleave"]
    # a benchmark without a row of its own: the group row does not document its options
    row = next(line for line in README.splitlines() if line.startswith("| `draftforge bench split RECIPE"))
    assert "no row of its own" in undocumented_options(README.replace(row + "\n", ""))[0]
    # a default that drifted
    drifted = README.replace("`--steps` timed optimizer steps a phase (default 40)",
                             "`--steps` timed optimizer steps a phase (default 20)")
    assert drifted != README
    assert missing_defaults(drifted) == ["bench split --steps: default 40"]
    # a machine-readable key the code does not print
    renamed = README.replace("`train_mfu=<MFU>", "`mfu=<MFU>")
    assert renamed != README
    assert wrong_last_lines(renamed) == ["bench train: mfu="]
