"""Session 58 (a recipe YAML review): a resolved recipe that did not load back (a name such as
'0815'), a quoted 'None' override refused for the file's unquoted None, aliases of aliases that
took a minute and gigabytes, line and column miscounted for CR line breaks and after a BOM, and a
tab hint that spoke of indentation for a tab that indents nothing."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import yaml
from test_cli_r15 import _run

from draftforge.config import load_recipe
from draftforge.recipe_errors import RecipeError
from draftforge.recipe_yaml import _RecipeDumper, _RecipeLoader

TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"




def _refused(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides or [])
    return str(info.value)


# --------------------------------------------------------------------------- 1. the writer


# each loads back as text: the first ones are what the loader reads as numbers unquoted
# (a leading zero is a decimal int, 1e5 a float), the last ones ordinary text
STRINGS = ["0815", "09", "0_8", "-09", "+08", "007", "1_000", "0x1F", "1e5", "1E-3", "1.5", ".5",
           ".inf", "None", "null", "~", "off", "yes", "1:30", "0b11", "", "hello", "runs/tiny-0815",
           "12abc", "v1.0"]


def test_every_string_the_loader_reads_as_a_number_is_written_quoted_and_loads_back():
    text = yaml.dump({"v": STRINGS}, Dumper=_RecipeDumper, sort_keys=False, width=1000)
    back = yaml.load(text, Loader=_RecipeLoader)["v"]
    assert [(s, type(s).__name__) for s in back] == [(s, "str") for s in STRINGS], text


def test_numbers_stay_plain_and_a_leading_zero_string_is_quoted():
    data = {"name": "0815", "steps": 815, "lr": 0.0001, "tag": "09", "dir": "runs/a"}
    text = yaml.dump(data, Dumper=_RecipeDumper, sort_keys=False)
    assert text == "name: '0815'\nsteps: 815\nlr: 0.0001\ntag: '09'\ndir: runs/a\n"
    assert yaml.load(text, Loader=_RecipeLoader) == data


def test_config_show_of_a_recipe_named_0815_loads_back(tmp_path, capsys):
    """The file's name is the recipe's name: '0815' was written unquoted, read back as int 815."""
    recipe = tmp_path / "0815.yaml"
    shutil.copy(TINY, recipe)
    code, shown, err = _run(["config", "show", recipe], capsys)
    assert code == 0, err
    assert "\nname: '0815'\n" in shown
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(shown, encoding="utf-8")
    code, again, err = _run(["config", "show", resolved], capsys)
    assert (code, err) == (0, "")
    assert again == shown
    assert load_recipe(resolved).name == "0815"


# --------------------------------------------------------------------------- 2. a quoted None


@pytest.mark.parametrize("quoted,unquoted", [
    ('export.out_dir="None"', "export.out_dir=None"),
    ('export={out_dir: "None"}', "export={out_dir: None}"),
])
def test_a_quoted_none_override_replaces_the_files_unquoted_none(tmp_path, quoted, unquoted):
    """The file's record that export.out_dir was an unquoted None outlived the override."""
    text = TINY.read_text(encoding="utf-8").replace(
        "export:\n  arch: Qwen3DSparkModel\n", "export:\n  arch: Qwen3DSparkModel\n  out_dir: None\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text, encoding="utf-8")
    line = text.splitlines().index("  out_dir: None") + 1
    assert f"r.yaml:{line}: export.out_dir: unquoted None is the string 'None'" in _refused(recipe)

    assert load_recipe(recipe, [quoted]).export.out_dir == "None"  # the string, as quoted
    # an unquoted None on the command line is refused there
    assert f"command line {unquoted!r}: export.out_dir: unquoted None is the string 'None'" in \
        _refused(recipe, [unquoted])
    # an override of the section's other key leaves the file's None, refused at its line
    message = _refused(recipe, ["export={arch: Qwen3DSparkModel}"])
    assert f"r.yaml:{line}: export.out_dir: unquoted None is the string 'None'" in message


# --------------------------------------------------------------------------- 3. aliases of aliases


class _TooMuchWork(BaseException):
    """Raised inside the code under test: BaseException, so no ``except Exception`` takes it."""


def _lines_run(call, budget: int):
    """``call()``, counting the lines run in draftforge's recipe_yaml module; more than
    ``budget`` of them raises _TooMuchWork (a bound on the work, not on the time)."""
    import draftforge.recipe_yaml as module

    count = 0
    where = module.__file__

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
            if count > budget:
                raise _TooMuchWork(f"more than {budget} lines run in recipe_yaml")
        return local

    def trace(frame, event, arg):
        return local if frame.f_code.co_filename == where else None

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        return call()
    finally:
        sys.settrace(previous)


BOMB = (  # 350 bytes that stand for 10**7 values: each level lists the one above ten times
    "x0: &a0 [1,1,1,1,1,1,1,1,1,1]\n"
    + "".join(f"x{n}: &a{n} [{','.join([f'*a{n - 1}'] * 10)}]\n" for n in range(1, 7))
    + "train:\n  steps: *a6\n"
)


def test_a_recipe_of_aliases_of_aliases_is_refused_at_the_alias_that_passes_the_limit(tmp_path):
    """It took 54 s and 4.4 GB: each alias was walked again at every use, and a line kept for
    every path of the expansion. By hand: x0 to x3 with their keys and the top mapping make
    1 + 12 + 112 + 1112 + 11112 = 12349 values, x4's key and list 2 more, and each *a3 on line 5
    adds 11111: the 8th passes 100000."""
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(BOMB, encoding="utf-8")
    with pytest.raises(RecipeError) as info:
        _lines_run(lambda: load_recipe(recipe), budget=20_000)
    assert info.value.problems == [
        f"{recipe}:5: the alias *a3 takes the recipe past 100000 values once its aliases are expanded "
        "(each alias repeats its anchor's values, and an alias of aliases multiplies them); a recipe "
        "holds a few hundred: use fewer aliases (*name) or write the values out"]

    # below the limit, a section shared through an alias and a merge still loads: the merged
    # mapping's unknown key is reported at its line, as before
    text = TINY.read_text(encoding="utf-8").replace(
        "eval:\n  num_prompts: 2\n  max_new_tokens: 32\n",
        "eval: &ev\n  num_prompts: 2\n  max_new_tokens: 32\n") + "x: {<<: *ev, num_prompts: 3}\n"
    recipe.write_text(text, encoding="utf-8")
    assert f"{recipe}:{len(text.splitlines())}: x: unknown key" in _refused(recipe)


def test_an_override_of_aliases_of_aliases_is_refused():
    """The same anchors in a flow list: 1 + 11 + 111 + 1111 + 11111 values before &a4's list
    (1 more), and the 8th *a3 in it passes 100000."""
    value = "[&a0 [1,1,1,1,1,1,1,1,1,1], " + ", ".join(
        f"&a{n} [{','.join([f'*a{n - 1}'] * 10)}]" for n in range(1, 7)) + "]"
    text = f"train.steps={value}"
    with pytest.raises(RecipeError) as info:
        _lines_run(lambda: load_recipe(TINY, [text]), budget=20_000)
    assert info.value.problems[0].startswith(
        f"command line {text!r}: the alias *a3 takes the recipe past 100000 values")


def test_duplicate_keys_in_an_aliased_mapping_cost_work_in_proportion(tmp_path):
    """Each duplicate key searched every line recorded so far: 25 s for this recipe of 37679
    key paths and 12111 duplicates (one in d0, one in each of its 12110 uses), under the limit."""
    text = ("d0: &d0 {a: 1, a: 2, b: 3}\n"
            "x0: &a0 [*d0,*d0,*d0,*d0,*d0,*d0,*d0,*d0,*d0,*d0]\n"
            "x1: &a1 [*a0,*a0,*a0,*a0,*a0,*a0,*a0,*a0,*a0,*a0]\n"
            "x2: &a2 [*a1,*a1,*a1,*a1,*a1,*a1,*a1,*a1,*a1,*a1]\n"
            "train:\n  steps: [*a2,*a2,*a2,*a2,*a2,*a2,*a2,*a2,*a2,*a2,*a2]\n")
    recipe = tmp_path / "dup.yaml"
    recipe.write_text(text, encoding="utf-8")
    message = _lines_run(lambda: _refused(recipe), budget=3_000_000)
    assert f"{recipe}:1: d0.a: duplicate key (first given at line 1)" in message
    assert f"{recipe}:1: train.steps[10][9][9][9].a: duplicate key (first given at line 1)" in message


# --------------------------------------------------------------------------- 4. line and column


@pytest.mark.parametrize("raw,where", [
    # by hand: 'train:' CR '  steps: 0' CR, then '  lr: ' is 6 characters: the 7th of line 3
    (b"train:\r  steps: 0\r  lr: \x01\r", "3: YAML syntax error: character #x0001 at column 7"),
    (b"train:\r  steps: 0\r  lr: \xff\r", "3: not UTF-8 text: byte 0xff at column 7"),
    # U+2028 and NEL (UTF-8 e2 80 a8, c2 85) end a line in YAML
    (b"train:\xe2\x80\xa8  lr: \x01\n", "2: YAML syntax error: character #x0001 at column 7"),
    (b"train:\xc2\x85  lr: \xff\n", "2: not UTF-8 text: byte 0xff at column 7"),
    # a byte-order mark is no column: 'name: ' is 6 characters
    (b"\xef\xbb\xbfname: \x01\n", "1: YAML syntax error: character #x0001 at column 7"),
    (b"\xef\xbb\xbfname: \xff\n", "1: not UTF-8 text: byte 0xff at column 7"),
])
def test_line_and_column_count_yamls_line_breaks_and_skip_a_bom(tmp_path, raw, where):
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(raw)
    assert f"{recipe}:{where} " in _refused(recipe)


def test_every_kind_of_line_break_counts_once(tmp_path):
    """CR LF is one break, as are CR, LF, NEL, U+2028 and U+2029: the bad character is the
    3rd of line 6."""
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(b"a: 1\r\nb: 2\rc: 3\nd: 4\xc2\x85e: 5\xe2\x80\xa9x: \x01\n")
    assert f"{recipe}:6: YAML syntax error: character #x0001 at column 4 " in _refused(recipe)


# --------------------------------------------------------------------------- 5. a tab


@pytest.mark.parametrize("text,hint", [
    # by hand: '  steps: 20' is 11 characters, the tab the 12th; it indents nothing
    ("train:\n  steps: 20\t# c\n", "2: YAML syntax error: while scanning for the next token: found "
     "character '\\t' that cannot start any token (a tab at column 12; use spaces)"),
    ("train:\n  lr:\t1\n", "2: YAML syntax error: while scanning for the next token: found "
     "character '\\t' that cannot start any token (a tab at column 6; use spaces)"),
])
def test_a_tab_after_the_lines_first_character_is_no_indentation(tmp_path, text, hint):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text, encoding="utf-8")
    message = _refused(recipe)
    assert f"{recipe}:{hint}" in message and "indents" not in message

    # before the line's first character, a tab is indentation (at column 1, or after spaces)
    recipe.write_text("train:\n\tsteps: 3\n", encoding="utf-8")
    assert "(a tab at column 1: YAML indents with spaces, not tabs)" in _refused(recipe)
    recipe.write_text("train:\n  \tsteps: 3\n", encoding="utf-8")
    assert "(a tab at column 3: YAML indents with spaces, not tabs)" in _refused(recipe)
