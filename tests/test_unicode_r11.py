"""Review round 11, data rows: a lone UTF-16 surrogate is refused where it is, not by a
traceback in the tokenizer or on the wire."""

from __future__ import annotations

import json

import pytest

from draftforge.data.formats import DataFormatError
from draftforge.data.loading import load_conversations


def _write(path, rows):
    # ensure_ascii keeps the surrogate as the escape "\ud800", which json.loads reads back
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize("row,what", [
    ({"id": "a\ud800", "prompt": "hi"}, r"'id' holds a lone UTF-16 surrogate \('\\ud800', character 2\)"),
    ({"messages": [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "x\udfff"}]},
     r"message 2 \(assistant\) content holds a lone UTF-16 surrogate \('\\udfff', character 2\)"),
    ({"system": "\ud83d", "prompt": "hi"}, r"'system' holds a lone UTF-16 surrogate"),
    ({"conversations": [{"from": "human", "value": "\ud83d"}]}, r"turn 1 \(user\) content holds"),
])
def test_a_lone_surrogate_is_refused_with_file_and_line(tmp_path, row, what):
    good = {"id": "g", "prompt": "fine"}
    path = _write(tmp_path / "rows.jsonl", [good, row])
    with pytest.raises(DataFormatError, match=rf"rows.jsonl, line 2: {what}"):
        load_conversations([path])
    result = load_conversations([path], skip_invalid=True)  # data.skip_invalid drops the row
    assert [c.id for c in result.conversations] == ["g"] and len(result.skipped) == 1


def test_a_surrogate_pair_is_one_valid_character(tmp_path):
    """JSON's escaped pair "\\ud83d\\ude00" is one emoji, read as such and kept."""
    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": "e\\ud83d\\ude00", "prompt": "smile \\ud83d\\ude00"}\n')
    [conv] = load_conversations([str(path)]).conversations
    assert conv.id == "e\U0001f600" and conv.messages[0]["content"] == "smile \U0001f600"
