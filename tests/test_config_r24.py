"""Recipe checks of review round 24: characters and tags that crashed the YAML loader, keys of
an override's value checked as a file's are, the lines of a duplicated section, and the line
of a byte that is not UTF-8."""

from __future__ import annotations

import pytest
from recipe_helpers import TINY_RECIPE as BASE  # line numbers below count from its first line
from recipe_helpers import problems

from draftforge import cli


def test_a_control_character_in_the_file_is_refused_at_its_line_not_a_traceback(tmp_path, capsys):
    """An ESC of a colour code pasted from a terminal (line 19, column 10: after "  steps: "): PyYAML's ReaderError
    escaped the loader, and the command printed a traceback."""
    path = tmp_path / "r.yaml"
    path.write_text(BASE + "  steps: \x1b[0m5\n")
    assert problems(path) == [
        f"{path}:19: YAML syntax error: character #x001b at column 10 is not allowed in YAML; remove it"
    ]
    assert cli.main(["config", "show", str(path)]) == 2
    assert f"{path}:19: YAML syntax error" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("  steps: !!int many", "cannot read 'many' as !!int"),
        ("  lr: !!float fast", "cannot read 'fast' as !!float"),
        ("  resume: !!timestamp soon", "cannot read 'soon' as !!timestamp"),
        ("  wandb: !!bool maybe", "cannot read 'maybe' as !!bool"),
    ],
)
def test_a_value_its_explicit_tag_cannot_read_is_refused_at_its_line(tmp_path, line, expected):
    """PyYAML's constructors raised ValueError, AttributeError or KeyError, which escaped."""
    path = tmp_path / "r.yaml"
    path.write_text(BASE + line + "\n")
    assert problems(path) == [f"{path}:19: YAML syntax error: {expected}"]


def test_a_value_its_explicit_tag_cannot_read_in_an_override_is_refused_naming_it(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(BASE)
    assert problems(path, ["train.steps=!!int many"]) == [
        "command line 'train.steps=!!int many': value is not valid YAML: cannot read 'many' as !!int"
    ]


def test_an_override_value_with_a_duplicate_key_is_refused_as_in_a_file(tmp_path):
    """YAML keeps the last of two equal keys: ce_weight 0.5 was taken and 0 silently dropped."""
    path = tmp_path / "r.yaml"
    path.write_text(BASE)
    text = "train.loss={ce_weight: 0, tv_weight: 1, ce_weight: 0.5}"
    assert problems(path, [text]) == [f"command line {text!r}: train.loss.ce_weight: duplicate key"]


def test_an_override_value_with_a_key_that_is_not_a_name_is_refused_at_its_section(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(BASE)
    text = "train.loss={1: 2}"
    assert problems(path, [text]) == [
        f"command line {text!r}: train.loss: keys must be plain names, got '1'"
    ]


def test_a_duplicated_section_is_located_by_the_value_yaml_kept_not_the_one_it_dropped(tmp_path):
    """The second ``draft:`` (line 19) replaces the first, whose draft.target_layer_ids [0, 1, 2]
    was at line 13: the defaults' ids [0, 8, 15, 22, 28] were blamed on line 13, and the default
    hidden_size 576 on line 10, which say 64. They come from the target's shape (lines 4, 5)."""
    path = tmp_path / "r.yaml"
    path.write_text(BASE + "draft:\n  block_size: 8\n")
    found = problems(path)
    assert found[0] == f"{path}:19: draft: duplicate key (first given at line 9)"
    assert f"{path}:4: draft.target_layer_ids[1]: layer id 8 is out of range" in found[1]
    assert found[-1].startswith(
        f"{path}:5: draft.hidden_size: 576 differs from the target's hidden_size 64"
    )
    assert not any(f"{path}:13:" in p or f"{path}:10:" in p for p in found), found


def test_a_byte_that_is_not_utf8_is_refused_at_its_line_and_column(tmp_path):
    """A Latin-1 'é' in a comment of line 14, column 23: the message gave only the byte offset."""
    path = tmp_path / "r.yaml"
    path.write_bytes(BASE.replace("block_size: 4", "block_size: 4  # caf\xe9").encode("latin-1"))
    assert problems(path) == [
        f"{path}:14: not UTF-8 text: byte 0xe9 at column 23 (invalid continuation byte); "
        "save the recipe as UTF-8"
    ]


def test_the_column_of_a_byte_that_is_not_utf8_counts_characters_not_bytes(tmp_path):
    """Line 19 is "name: héllo \\xe9": the bad byte is the 13th character (the 14th byte)."""
    path = tmp_path / "r.yaml"
    path.write_bytes(BASE.encode() + "name: héllo ".encode() + b"\xe9\n")
    assert problems(path) == [
        f"{path}:19: not UTF-8 text: byte 0xe9 at column 13 (invalid continuation byte); "
        "save the recipe as UTF-8"
    ]
