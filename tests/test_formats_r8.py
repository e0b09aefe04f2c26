"""Round-8 data format fixes: each test fails without its fix."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftforge.data.formats import DataFormatError, RowLocation, parse_row
from draftforge.data.loading import load_conversations

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _parse(row, expect="conversation"):
    return parse_row(row, RowLocation("d.jsonl", 3), default_id="d-3", expect=expect)


def test_an_empty_system_key_is_no_system_prompt():
    # LLaMA-Factory writes "system": "" for a row without one; it became an empty system
    # message, which replaces the template's default system prompt
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    turns = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]
    assert _parse({"messages": messages, "system": ""}).messages == messages
    assert _parse({"conversations": turns, "system": ""}).messages == messages
    assert _parse({"prompt": "Hi", "system": ""}, expect="prompt").messages == messages[:1]
    assert _parse({"prompt": "Hi", "system": ""}, expect="prompt").system is None
    # beside a system message it is no second system prompt
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    assert _parse({"messages": with_system, "system": ""}).messages == with_system


@pytest.mark.integration
def test_an_empty_system_key_is_regenerated_with_smollm2s_default_system_prompt():
    """What the target answers is the prompt rendered by transformers itself; with no system
    prompt SmolLM2's template puts its default one first, as when serving the bare prompt."""
    from transformers import AutoTokenizer

    from draftforge.data.tokenize import render
    from draftforge.splitserve import smollm2

    tok = AutoTokenizer.from_pretrained(smollm2.ensure_smollm2())
    conv = _parse({"prompt": "Hi", "system": ""}, expect="prompt")
    expected = (f"<|im_start|>system\n{SMOLLM2_DEFAULT_SYSTEM}<|im_end|>\n"
                "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert render(tok, conv.messages, add_generation_prompt=True) == expected


def test_turn_order_errors_name_the_turn_of_the_rows_own_list(tmp_path):
    # a top-level 'system' key shifted every number by one, and ShareGPT turns were called
    # messages: the error pointed at the wrong entry of the file
    path = tmp_path / "chats.jsonl"
    rows = [
        {"id": "ok", "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
        {"system": "S", "conversations": [{"from": "human", "value": "Q"}, {"from": "human", "value": "Q2"},
                                          {"from": "gpt", "value": "A"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataFormatError) as err:
        load_conversations([str(path)], expect="conversation")
    assert str(err.value).startswith(f"{path}, line 2: turn 2 is 'user' where 'assistant' is expected")
    stray = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
             {"role": "system", "content": "S2"}]
    with pytest.raises(DataFormatError, match=r"^d.jsonl, line 3: message 3 is a system message; "):
        _parse({"system": "S", "messages": stray})
    with pytest.raises(DataFormatError, match=r"^d.jsonl, line 3: turn 1 is 'assistant' where 'user'"):
        _parse({"conversations": [{"from": "gpt", "value": "A"}, {"from": "human", "value": "Q"}]})
    # without a system key the numbers were right and stay so
    with pytest.raises(DataFormatError, match=r"^d.jsonl, line 3: message 4 is a system message; "):
        _parse({"messages": [{"role": "system", "content": "S"}, *stray]})


def test_a_row_with_null_columns_is_not_said_to_have_the_keys_it_lacks(tmp_path):
    # parquet fills a column a row lacks with null; the row was said to have no 'messages'
    # while 'messages' was listed among its keys
    path = tmp_path / "mixed.parquet"
    rows = [{"id": "a", "prompt": "Hi", "messages": None}, {"id": "b", "prompt": None, "messages": None}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataFormatError) as err:
        load_conversations([str(path)])
    assert str(err.value) == (f"{path}, row 2: the row has no 'messages', 'conversations' or "
                              "'prompt' (its keys: id; null: messages, prompt)")


def test_a_gzip_file_cut_short_says_after_which_line(tmp_path):
    # three whole lines in a first gzip member, then a second member cut in the middle of
    # line 4: the error named the file only
    good = "".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(3))
    cut = gzip.compress((json.dumps({"prompt": "x" * 200_000}) + "\n").encode())
    path = tmp_path / "prompts.jsonl.gz"
    path.write_bytes(gzip.compress(good.encode()) + cut[: len(cut) // 2])
    with pytest.raises(DataFormatError) as err:
        load_conversations([str(path)])
    assert str(err.value) == (f"{path}: cannot be read: Compressed file ended before the "
                              "end-of-stream marker was reached (after line 3)")


def test_a_file_listed_twice_is_refused_as_such(tmp_path, monkeypatch):
    # it was refused as an id clash of its first row with itself, with the hint that two
    # files share a name: rename one
    (tmp_path / "a.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataFormatError) as err:
        load_conversations(["a.jsonl", str(tmp_path / "a.jsonl")])
    assert str(err.value) == (f"{tmp_path / 'a.jsonl'}: listed twice in data.train_files (as "
                              f"'a.jsonl' and '{tmp_path / 'a.jsonl'}'); its rows would be read twice")
    # two files of one name in two folders are still two files
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "a.jsonl").write_text(json.dumps({"id": "other", "prompt": "yo"}) + "\n")
    assert len(load_conversations(["a.jsonl", "b/a.jsonl"]).conversations) == 2
