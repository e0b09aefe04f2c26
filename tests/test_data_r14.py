"""Review round 14 of data formats: a chat template given as a file path, a blank line in a
regenerated file, which item of a 'prompt' list is not a string, which user turn is empty, and
unfinished_turns beside a top-level 'system' key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from regenerate_helpers import SETTINGS, FakeEngine, make_prompts

from draftforge.data.formats import DataFormatError, RowLocation, parse_row

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
WHERE = RowLocation("data.jsonl", 3)


def test_a_chat_template_file_path_is_refused_at_its_recipe_line(tmp_path):
    """target.generation.chat_template: templates/chatml.jinja (SGLang's --chat-template takes a
    path) was used as the template's text: every prompt rendered as that path, regeneration
    answered it for hours, and only tokenization refused the answers."""
    from draftforge.config import RecipeError, load_recipe

    text = RECIPE.read_text()
    assert "  generation:\n    max_new_tokens: 32" in text
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text.replace(
        "  generation:\n", "  generation:\n    chat_template: templates/chatml.jinja\n", 1))
    line = recipe.read_text().splitlines().index("    chat_template: templates/chatml.jinja") + 1
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe)
    assert str(err.value) == (
        f"{recipe}:{line}: target.generation.chat_template: 'templates/chatml.jinja' has no "
        "Jinja markup ({{ or {%): the option takes the template's Jinja text (e.g. as a YAML "
        "block scalar, chat_template: |), not a file path or a template name"
    )
    with pytest.raises(RecipeError) as err:
        load_recipe(RECIPE, ["target.generation.chat_template=chatml"])
    assert str(err.value).startswith(
        "command line 'target.generation.chat_template=chatml': target.generation.chat_template: "
        "'chatml' has no Jinja markup")
    # the template's text, as a block scalar, loads unchanged
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    recipe.write_text(text.replace(
        "  generation:\n", f"  generation:\n    chat_template: |-\n      {template}\n", 1))
    assert load_recipe(recipe).target.generation.chat_template == template


def test_a_blank_line_inside_a_regenerated_file_is_skipped_as_training_skips_it(tmp_path, capsys):
    """A blank line between two rows (an edit, or files joined with one between them) was
    "not a regenerated row ...; this file was not written by 'draftforge data regenerate' --
    move it away and rerun": every answer thrown away, though the data loader skips it."""
    from draftforge.data.loading import load_conversations
    from draftforge.data.regenerate import check_answers, regenerate

    out = tmp_path / "answers.jsonl"
    regenerate(make_prompts(5), FakeEngine(), SETTINGS, out, progress=False)
    lines = out.read_bytes().splitlines(keepends=True)
    assert len(lines) == 5
    edited = b"".join(lines[:2]) + b"\n   \r\n" + b"".join(lines[2:])
    out.write_bytes(edited)
    loaded = load_conversations([str(out)], expect="conversation").conversations
    assert [c.id for c in loaded] == [f"p{i:02d}" for i in range(5)]
    check_answers(out, make_prompts(5), SETTINGS, "fake-target")
    capsys.readouterr()
    engine = FakeEngine()
    report = regenerate(make_prompts(5), engine, SETTINGS, out, progress=False)
    assert (report.num_generated, report.num_reused) == (0, 5) and engine.calls == []
    assert "all 5 prompts already answered" in capsys.readouterr().err
    assert out.read_bytes() == edited
    # a line that is no JSON at all is still refused where it is
    out.write_bytes(b"".join(lines[:2]) + b"x\n" + b"".join(lines[2:]))
    from draftforge.data.regenerate import RegenerationError

    with pytest.raises(RegenerationError, match=rf"{out}, line 3: not a regenerated row"):
        check_answers(out, make_prompts(5), SETTINGS, "fake-target")


@pytest.mark.parametrize(("prompt", "item", "kind"), [
    (["a", 5], 2, "int"), ([None], 1, "null"), (["a", "b", ["c"]], 3, "list")])
def test_a_prompt_list_names_the_item_that_is_not_a_string(prompt, item, kind):
    with pytest.raises(DataFormatError) as err:
        parse_row({"prompt": prompt}, WHERE, default_id="x")
    assert str(err.value) == (
        f"data.jsonl, line 3: 'prompt' must be a string or a list of strings; its item {item} "
        f"is {kind}")


@pytest.mark.parametrize(("row", "named"), [
    ({"prompt": ["first", "second", " \n"]}, "turn 3"),
    ({"system": "s", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
        {"role": "user", "content": ""}, {"role": "assistant", "content": "b"}]}, "message 3"),
    ({"conversations": [
        {"from": "system", "value": "s"}, {"from": "human", "value": "\t"},
        {"from": "gpt", "value": "a"}]}, "turn 2"),
])
def test_an_empty_user_turn_is_named(row, named):
    """"a user turn is empty" left the user to search a long conversation for it; it is named
    as the row's own list counts it (a top-level 'system' key shifts nothing)."""
    for expect in ("prompt", "conversation"):
        if "prompt" in row and expect == "conversation":
            continue
        with pytest.raises(DataFormatError) as err:
            parse_row(row, WHERE, default_id="x", expect=expect)
        assert str(err.value) == f"data.jsonl, line 3: {named} (user) is empty"


def test_unfinished_turns_index_the_rows_own_list_beside_a_system_key():
    """With a top-level 'system' key the row's unfinished_turns were checked against the list
    with the system message put in front: the row's own index of its cut reply was refused (or
    the reply before it was taken as the cut one), and the error listed shifted indices."""
    turns = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
             {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    conv = parse_row({"system": "s", "messages": turns, "unfinished_turns": [3]}, WHERE,
                     default_id="x", expect="conversation")
    # the Conversation's messages start with the system message: its index of a2 is 4
    assert conv.messages[0] == {"role": "system", "content": "s"}
    assert conv.extra["unfinished_turns"] == [4]
    assert conv.messages[4]["content"] == "a2"
    sharegpt = parse_row({"system": "s", "conversations": [
        {"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"}], "unfinished_turns": [1]},
        WHERE, default_id="x", expect="conversation")
    assert sharegpt.extra["unfinished_turns"] == [2]
    with pytest.raises(DataFormatError) as err:
        parse_row({"system": "s", "messages": turns, "unfinished_turns": [2]}, WHERE,
                  default_id="x", expect="conversation")
    assert str(err.value) == (
        "data.jsonl, line 3: unfinished_turns must list the indices of assistant messages "
        "(replies cut at the generation limit), got [2]; assistant messages here: [1, 3]")
    # an empty system key adds no message: nothing shifts
    plain = parse_row({"system": "", "messages": turns, "unfinished_turns": [1, 3]}, WHERE,
                      default_id="x", expect="conversation")
    assert plain.extra["unfinished_turns"] == [1, 3]
    assert json.dumps(plain.messages) == json.dumps(turns)


def test_a_parquet_column_of_sharegpt_and_specforge_turns_loads_as_jsonl_does(tmp_path):
    """'conversations' takes ShareGPT's from/value turns and SpecForge's role/content ones, and
    a jsonl file mixing the two loads; as parquet, whose column of turns has all four fields
    (null where a turn lacks one), the role/content rows were refused: "turn 1 has 'from' None;
    valid values: system, human, gpt"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from draftforge.data.loading import load_conversations

    rows = [
        {"id": "sharegpt", "conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"}]},
        {"id": "specforge", "conversations": [
            {"role": "system", "content": "s"}, {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2"}]},
    ]
    expected = {
        "sharegpt": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}],
        "specforge": [{"role": "system", "content": "s"}, {"role": "user", "content": "q2"},
                      {"role": "assistant", "content": "a2"}],
    }
    jsonl = tmp_path / "mixed.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    assert pq.read_table(parquet).to_pylist()[1]["conversations"][0]["from"] is None
    for path in (jsonl, parquet):
        loaded = load_conversations([str(path)], expect="conversation").conversations
        assert {c.id: c.messages for c in loaded} == expected
    # a turn with neither is still refused as before
    with pytest.raises(DataFormatError) as err:
        parse_row({"conversations": [{"from": None, "role": None, "value": "q"}]}, WHERE, default_id="x")
    assert str(err.value) == "data.jsonl, line 3: turn 1 has 'from' None; valid values: system, human, gpt"
