"""The recipe reference (`draftforge config keys`, recipes/README.md) covers every key."""

from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field

from draftforge import cli
from draftforge.config import load_recipe
from draftforge.reference import bounds, default_text, reference, type_name, undocumented, walk
from draftforge.section import Section

ROOT = Path(__file__).resolve().parents[1]


def _leaves(tree: dict, prefix: str = "") -> set[str]:
    """Dotted keys of the leaves of a dumped recipe: an independent list of every key."""
    keys = set()
    for name, value in tree.items():
        if isinstance(value, dict):
            keys |= _leaves(value, f"{prefix}{name}.")
        else:
            keys.add(prefix + name)
    return keys


def test_committed_reference_is_the_generated_one():
    committed = (ROOT / "recipes" / "README.md").read_text()
    assert committed == reference(), (
        "recipes/README.md is out of date: run 'draftforge config keys > recipes/README.md'"
    )


def test_every_key_has_a_meaning():
    assert undocumented() == []


def test_reference_lists_exactly_the_keys_a_recipe_holds():
    # tiny-debug declares target.shape, so its dump has every section and every key.
    dumped = load_recipe(ROOT / "recipes" / "tiny-debug.yaml").model_dump(mode="json")
    text = reference()
    listed = {line.split("`")[1] for line in text.splitlines() if line.startswith("| `")}
    sections = {"target.shape", "target.generation", "train.loss"}
    assert listed - sections == _leaves(dumped)


def test_cli_prints_the_reference(capsys):
    assert cli.main(["config", "keys"]) == 0
    assert capsys.readouterr().out == reference()


class _Inner(Section):
    """Inner section.

    More about it.
    """

    depth: int = Field(default=3, ge=1, lt=10, description="how deep")


class _Outer(Section):
    """Outer."""

    mode: Literal["a", "b"] = "a"
    rate: float | None = Field(default=None, gt=0, description="a <rate> | with *stars*")
    names: list[str] = Field(default_factory=lambda: ["x:y", "z"])
    required: int = Field(description="no default")
    flag: bool = True
    inner: _Inner = Field(default_factory=_Inner)
    maybe: _Inner | None = None


@pytest.mark.parametrize(
    ("key", "type_text", "default", "bound"),
    [
        ("mode", "`a` \\| `b`", "`a`", ""),
        ("rate", "float or null", "null", "> 0"),
        ("names", "list of str", "`['x:y', z]`", ""),
        ("required", "int", "required", ""),
        ("flag", "bool", "`true`", ""),
        ("inner", "section", "(section)", ""),
        ("maybe", "section or null", "null", ""),
        ("inner.depth", "int", "`3`", ">= 1, < 10"),
    ],
)
def test_cells_of_a_hand_made_section(key, type_text, default, bound):
    field = dict(walk(_Outer))[key]
    assert (type_name(field.annotation), default_text(field), bounds(field)) == (
        type_text, default, bound
    )


def test_table_escapes_markdown_and_names_sections_by_their_first_docstring_line():
    from draftforge.reference import _table

    text = _table("t", list(walk(_Outer)))
    assert "| a &lt;rate> \\| with \\*stars\\* |" in text
    assert "| `inner` | section | (section) |  | Inner section. |" in text
    assert undocumented(_Outer) == ["mode", "names", "flag"]
