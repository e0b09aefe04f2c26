"""Round-6 data fixes: each test fails without its fix."""

from __future__ import annotations

import gzip
import json

import pytest

from draftforge.data.formats import DataFormatError
from draftforge.data.loading import load_conversations


def _corrupt_gzip(rows_text: str) -> bytes:
    """A gzip file whose header is intact but whose deflate stream is damaged: gzip raises
    zlib.error (not OSError) while decompressing it."""
    data = bytearray(gzip.compress(rows_text.encode()))
    for i in range(200, 260):
        data[i] ^= 0x55
    return bytes(data)


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".json.gz"])
def test_a_corrupt_gzip_data_file_is_a_data_error_naming_it(tmp_path, suffix):
    rows = [{"id": f"r{i}", "prompt": f"hello there {i} " * 20} for i in range(2000)]
    text = ("".join(json.dumps(r) + "\n" for r in rows) if suffix == ".jsonl.gz"
            else json.dumps(rows))
    path = tmp_path / f"prompts{suffix}"
    path.write_bytes(_corrupt_gzip(text))
    with pytest.raises(DataFormatError, match=rf"prompts{suffix.replace('.', '[.]')}: cannot be read: "
                                              r"Error -3 while decompressing"):
        load_conversations([str(path)])
    # skip_invalid skips malformed rows, never an unreadable file
    with pytest.raises(DataFormatError, match="cannot be read"):
        load_conversations([str(path)], skip_invalid=True)


def _parse(row, expect="conversation"):
    from draftforge.data.formats import RowLocation, parse_row

    return parse_row(row, RowLocation("d.jsonl", 3), default_id="d-3", expect=expect)


def test_a_system_key_beside_the_turns_is_the_system_prompt_of_every_form():
    # LLaMA-Factory's ShareGPT rows keep the system prompt in a top-level 'system' key; it
    # was dropped silently for the messages and ShareGPT forms (kept for plain prompts only)
    turns = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    expected = [{"role": "system", "content": "Be brief."}, *messages]
    for row in ({"conversations": turns, "system": "Be brief."},
                {"messages": messages, "system": "Be brief."}):
        conv = _parse(row)
        assert conv.messages == expected and conv.system == "Be brief."
    prompt = _parse({"prompt": "Hi", "system": "Be brief."}, expect="prompt")
    assert prompt.messages == expected[:2]
    # null (a parquet column other rows fill) is no system prompt
    assert _parse({"messages": messages, "system": None}).messages == messages


def test_a_system_key_and_a_system_message_in_one_row_are_refused():
    messages = [{"role": "system", "content": "A"}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}]
    with pytest.raises(DataFormatError, match=r"d.jsonl, line 3: the row has a 'system' key and its "
                                              r"'messages' start with a system message too"):
        _parse({"messages": messages, "system": "B"})
    with pytest.raises(DataFormatError, match=r"d.jsonl, line 3: 'system' must be a string, got int"):
        _parse({"messages": messages[1:], "system": 5})


def test_the_overlap_check_sees_a_system_key():
    from draftforge.data.overlap import OverlapIndex, find_overlaps

    stub = "def add(a, b):\n    \"\"\"Return the sum of a and b, twice over.\"\"\"\n"
    index = OverlapIndex([("HumanEval/x", stub)])
    conv = _parse({"messages": [{"role": "user", "content": "Go on."},
                                {"role": "assistant", "content": "Ok"}], "system": stub})
    assert [h.eval_id for h in find_overlaps([conv], index)] == ["HumanEval/x"]
