"""Recipe checks of review round 24, continued: YAML 1.1's boolean words named as written where
a string was meant, its base-60 and binary numbers read as the strings YAML 1.2 reads, a key
that is not a string reported once, a name that would break the written recipe's header, and a
null target.shape blamed on that key."""

from __future__ import annotations

import pytest
from recipe_helpers import TINY_RECIPE as BASE  # line numbers below count from its first line
from recipe_helpers import problems

from draftforge.config import dump_recipe, load_recipe, parse_override


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("  resume: no", "train.resume: expected str, got bool False (unquoted no is a boolean in YAML; "
                         "quote it: 'no')"),
        ("  wandb_mode: off", "train.wandb_mode: False is not one of 'offline', 'online', 'disabled' "
                              "(unquoted off is a boolean in YAML, not the string 'off')"),
    ],
)
def test_an_unquoted_boolean_word_where_a_string_was_meant_is_named_as_written(tmp_path, line, expected):
    """The message said only "got bool False": nothing told that YAML 1.1 reads off as false."""
    path = tmp_path / "r.yaml"
    path.write_text(BASE + line + "\n")
    assert problems(path) == [f"{path}:19: {expected}"]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        # a shell strips a bare 'no' to no: the advice is the shell's form (round 58)
        ("train.resume=no", "train.resume: expected str, got bool False (unquoted no is a boolean "
                            "in YAML; quote it, in a shell: train.resume='\"no\"')"),
        ("train={resume: YES}", "train.resume: expected str, got bool True (unquoted YES is a boolean "
                                "in YAML; quote it, in a shell: train.resume='\"YES\"')"),
        ("train.wandb_mode=off", "train.wandb_mode: False is not one of 'offline', 'online', "
                                 "'disabled' (unquoted off is a boolean in YAML, not the string 'off')"),
    ],
)
def test_an_unquoted_boolean_word_in_an_override_is_named_as_written(tmp_path, override, expected):
    path = tmp_path / "r.yaml"
    path.write_text(BASE)
    assert problems(path, [override]) == [f"command line {override!r}: {expected}"]


def test_a_quoted_boolean_word_and_a_real_boolean_get_no_hint(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(BASE + "  resume: 'no'\n  wandb_mode: 'off'\n")
    assert problems(path) == [
        f"{path}:20: train.wandb_mode: 'off' is not one of 'offline', 'online', 'disabled' "
        "(did you mean 'offline'?)"
    ]
    path.write_text(BASE)
    assert problems(path, ["train.steps=true"]) == [
        "command line 'train.steps=true': train.steps: expected int, got bool True"
    ]


@pytest.mark.parametrize("text", ["1:30", "0b11", "-1:30:00"])
def test_base_60_and_binary_numbers_are_strings_an_int_key_refuses_by_their_text(tmp_path, text):
    """YAML 1.1 read 1:30 as 90 and 0b11 as 3, taken silently as a block size or step count."""
    path = tmp_path / "r.yaml"
    path.write_text(BASE.replace("block_size: 4", f"block_size: {text}"))
    assert problems(path) == [f"{path}:14: draft.block_size: expected int, got str {text!r}"]
    path.write_text(BASE)
    assert problems(path, [f"train.steps={text}"]) == [
        f"command line 'train.steps={text}': train.steps: expected int, got str {text!r}"
    ]


def test_a_name_that_looks_like_a_time_is_taken_as_written(tmp_path):
    """name: 12:30 said "expected str, got int 750"."""
    path = tmp_path / "r.yaml"
    path.write_text(BASE + "name: 12:30\n")
    cfg = load_recipe(path)
    assert cfg.name == "12:30"
    dump_recipe(cfg, tmp_path / "config.yaml")
    assert load_recipe(tmp_path / "config.yaml") == cfg


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("8", 8), ("-3", -3), ("1_000", 1000), ("010", 10), ("0x10", 16), ("0", 0),
        ("1.5", 1.5), (".5", 0.5), ("1e-4", 1e-4), ("1.0e-4", 1e-4), ("-2.5E+3", -2500.0),
        ("1_0.5", 10.5), ("1:30", "1:30"), ("1:30.5", "1:30.5"), ("0b11", "0b11"),
        ("!!int 1:30", 90), ("!!int 0b11", 3),
    ],
)
def test_numbers_read_as_before_but_base_60_and_binary(text, value):
    (_, got) = parse_override(f"train.steps={text}")
    assert got == value and type(got) is type(value)


def test_a_key_that_is_not_a_string_is_reported_once_at_its_line(tmp_path):
    """It was reported again, with no line, by pydantic: "r.yaml: [1]: Keys should be strings"."""
    path = tmp_path / "r.yaml"
    path.write_text(BASE + "  loss:\n    ~: 2\n1: 2\n")
    assert problems(path) == [
        f"{path}:20: train.loss: keys must be plain names, got '~'",
        f"{path}:21: top level: keys must be plain names, got '1'",
    ]


def test_a_key_that_is_not_a_string_is_reported_with_the_other_problems(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(BASE + "  1: 2\n  steps: -1\n")
    assert problems(path) == [
        f"{path}:19: train: keys must be plain names, got '1'",
        f"{path}:20: train.steps: must be greater than 0, got int -1",
    ]


def test_a_name_with_a_line_break_keeps_the_written_recipe_loadable(tmp_path):
    """The header comment "# draftforge resolved recipe 'a" ended at the line break, and its
    second line "b: 1'" was a key: the run's config.yaml did not load."""
    path = tmp_path / "r.yaml"
    path.write_text(BASE + 'name: "a\\nb: 1\\r\\u2028c"\n')
    cfg = load_recipe(path)
    assert cfg.name == "a\nb: 1\r\u2028c"
    written = dump_recipe(cfg, tmp_path / "config.yaml")
    assert written.read_text().startswith("# draftforge resolved recipe 'a\\nb: 1\\r\\u2028c'\n")
    assert load_recipe(written) == cfg


def test_a_plain_name_is_in_the_header_as_before(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(BASE + "name: tiny-run\n")
    assert load_recipe(path).to_yaml().startswith("# draftforge resolved recipe 'tiny-run'\nname: tiny-run\n")


@pytest.mark.parametrize("override", ["target.shape=null", "target.shape="])
def test_a_null_shape_of_a_random_target_is_blamed_on_the_override(tmp_path, override):
    """It was blamed on the file's line 1, "target:", which the override had not changed."""
    path = tmp_path / "r.yaml"
    path.write_text(BASE)
    assert problems(path, [override]) == [
        f"command line {override!r}: target.shape: model 'random' needs a declared 'shape' "
        "section, not null"
    ]


@pytest.mark.parametrize("line", ["  shape: null", "  shape:"])
def test_a_null_shape_of_a_random_target_in_the_file_is_blamed_on_its_line(tmp_path, line):
    path = tmp_path / "r.yaml"
    path.write_text("name: x\ntarget:\n  model: random\n" + line + "\n")
    assert problems(path) == [
        f"{path}:4: target.shape: model 'random' needs a declared 'shape' section, not null"
    ]
