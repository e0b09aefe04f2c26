"""Row parsing: the three row forms, ids, and one test per malformed-row message."""

from __future__ import annotations

import json

import pytest

from draftforge.data.formats import DataFormatError, RowLocation, parse_row
from draftforge.data.loading import load_conversations

WHERE = RowLocation("chats.jsonl", 7, "line")


def parse(row, **kwargs):
    return parse_row(row, WHERE, default_id="chats-7", **kwargs)


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


# ------------------------------------------------------------------ the three forms


def test_openai_messages():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    conv = parse({"id": "a1", "messages": msgs}, expect="conversation")
    assert conv.id == "a1"
    assert conv.messages == msgs
    assert conv.system == "Be brief."
    assert conv.source == "chats.jsonl, line 7"


def test_sharegpt_maps_roles():
    row = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "Q1"},
            {"from": "gpt", "value": "A1"},
            {"from": "human", "value": "Q2"},
            {"from": "gpt", "value": "A2"},
        ]
    }
    conv = parse(row, expect="conversation")
    assert [m["role"] for m in conv.messages] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert [m["content"] for m in conv.messages] == ["S", "Q1", "A1", "Q2", "A2"]
    assert conv.id == "chats-7"  # no id field: file stem + line


def test_prompt_string_and_turns_with_system():
    assert parse({"prompt": "Why?"}).messages == [{"role": "user", "content": "Why?"}]
    conv = parse({"prompt": ["One", "Two"], "system": "Sys", "id": 12})
    assert conv.id == "12"
    assert conv.messages == [
        {"role": "system", "content": "Sys"},
        {"role": "user", "content": "One"},
        {"role": "user", "content": "Two"},
    ]
    assert conv.user_turns == ["One", "Two"]


def test_prompt_expectation_drops_assistant_turns():
    msgs = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "old answer"},
        {"role": "user", "content": "Q2"},
    ]
    conv = parse({"messages": msgs}, expect="prompt")
    assert conv.messages == [msgs[0], msgs[2]]


def test_explicit_format_requires_its_key():
    with pytest.raises(DataFormatError, match=r"no 'conversations' \(data.format: sharegpt\)"):
        parse({"messages": [{"role": "user", "content": "x"}]}, fmt="sharegpt")


# ------------------------------------------------------------------ malformed rows


def test_error_invalid_json_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ['{"prompt": "ok"}', '{"prompt": "broken'])
    with pytest.raises(DataFormatError) as err:
        load_conversations([path])
    assert str(err.value).startswith(f"{path}, line 2: invalid JSON: ")


def test_error_row_not_an_object(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ['{"prompt": "ok"}', "", '["a", "b"]'])
    with pytest.raises(DataFormatError) as err:
        load_conversations([path])
    assert str(err.value) == f"{path}, line 3: a row must be a JSON object, got a list"


def test_error_missing_messages_conversations_prompt():
    with pytest.raises(DataFormatError) as err:
        parse({"text": "hello", "id": 1})
    assert str(err.value) == (
        "chats.jsonl, line 7: the row has no 'messages', 'conversations' or 'prompt' "
        "(its keys: id, text)"
    )


def test_error_wrong_role_name():
    with pytest.raises(DataFormatError) as err:
        parse({"messages": [{"role": "human", "content": "hi"}]})
    assert str(err.value) == (
        "chats.jsonl, line 7: message 1 has role 'human'; valid roles: system, user, assistant"
    )


def test_error_wrong_sharegpt_speaker():
    with pytest.raises(
        DataFormatError, match=r"turn 2 has 'from' 'bot'; valid values: system, human, gpt"
    ):
        parse({"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "x"}]})


def test_error_content_not_a_string():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ["x"]}]
    with pytest.raises(DataFormatError) as err:
        parse({"messages": msgs}, expect="conversation")
    assert str(err.value) == (
        "chats.jsonl, line 7: message 2 (assistant) content must be a string, got list"
    )


def test_error_missing_content():
    with pytest.raises(DataFormatError, match=r"line 7: message 1 \(user\) has no 'content'"):
        parse({"messages": [{"role": "user"}]})


def test_error_empty_conversation():
    with pytest.raises(DataFormatError) as err:
        parse({"messages": []})
    assert str(err.value) == "chats.jsonl, line 7: the conversation is empty"


def test_error_no_user_turn():
    with pytest.raises(DataFormatError) as err:
        parse({"messages": [{"role": "system", "content": "only a system prompt"}]})
    assert str(err.value) == "chats.jsonl, line 7: the conversation has no user turn"


def test_error_ends_in_user_where_conversation_expected():
    msgs = [{"role": "user", "content": "Q"}]
    with pytest.raises(DataFormatError, match=r"line 7: the conversation ends with a user turn"):
        parse({"messages": msgs}, expect="conversation")


def test_error_turns_not_alternating():
    msgs = [
        {"role": "user", "content": "Q"},
        {"role": "user", "content": "Q again"},
        {"role": "assistant", "content": "A"},
    ]
    with pytest.raises(DataFormatError, match=r"message 2 is 'user' where 'assistant' is expected"):
        parse({"messages": msgs}, expect="conversation")


def test_error_system_not_first():
    msgs = [{"role": "user", "content": "Q"}, {"role": "system", "content": "S"}]
    with pytest.raises(
        DataFormatError, match=r"message 2 is a system message; only the first may be"
    ):
        parse({"messages": msgs})


def test_error_bad_id_and_bad_prompt_type():
    with pytest.raises(DataFormatError, match=r"'id' must be a string or an integer, got list"):
        parse({"prompt": "x", "id": [1]})
    with pytest.raises(DataFormatError, match=r"'prompt' must be a string or a list of strings"):
        parse({"prompt": 5})


def test_error_plain_prompt_cannot_be_trained_on_directly():
    with pytest.raises(DataFormatError, match=r"plain 'prompt' row has no reply to train on"):
        parse({"prompt": "x"}, expect="conversation")


def test_row_number_counts_blank_lines(tmp_path):
    rows = [json.dumps({"prompt": "a"}), "", json.dumps({"messages": []})]
    path = write_jsonl(tmp_path / "x.jsonl", rows)
    with pytest.raises(DataFormatError, match=r"x.jsonl, line 3: the conversation is empty"):
        load_conversations([path])


def test_unfinished_turns_must_index_assistant_replies():
    """Written by 'data regenerate'; a parquet column other rows fill with null means none. A
    string or null used to crash tokenising with a bare TypeError naming no row."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    assert parse({"messages": msgs, "unfinished_turns": [1]}, expect="conversation").extra["unfinished_turns"] == [1]
    assert parse({"messages": msgs, "unfinished_turns": None}, expect="conversation").extra["unfinished_turns"] == []
    for bad in ("1", [0], [True], {"1": 1}):
        with pytest.raises(DataFormatError, match=r"chats.jsonl, line 7: unfinished_turns must list the "
                                                  r"indices of assistant messages.*assistant messages here: \[1\]"):
            parse({"messages": msgs, "unfinished_turns": bad}, expect="conversation")


def test_a_regenerated_file_read_as_prompts_drops_its_cut_replies(tmp_path):
    """A regenerated.jsonl given as data.train_files: its replies and which of them were cut go
    (the target answers anew); a bad unfinished_turns is still refused."""
    msgs = [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "Once upon"}]
    row = {"id": "b", "messages": msgs, "unfinished_turns": [1], "target": "final"}
    path = write_jsonl(tmp_path / "regenerated.jsonl", [json.dumps(row)])
    [prompt] = load_conversations([path], expect="prompt").conversations
    assert prompt.messages == msgs[:1]
    assert prompt.extra == {"target": "final"}
    with pytest.raises(DataFormatError, match=r"chats.jsonl, line 7: unfinished_turns must list"):
        parse({"messages": msgs, "unfinished_turns": [0]}, expect="prompt")
