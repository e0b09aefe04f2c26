"""Review round 43: data input formats and loss masks.

1. A ShareGPT turn whose ``from`` (or SpecForge's ``role``) is a list or an object is a
   malformed row named by its file and line (it was a bare ``TypeError: unhashable type``
   from the role look-up, with no file or line, and ``data.skip_invalid`` did not skip it).
"""

from __future__ import annotations

import json

import pytest

from draftforge.data.formats import DataFormatError
from draftforge.data.loading import load_conversations


def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


GOOD = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}


@pytest.mark.parametrize(
    ("turn", "key"),
    [
        ({"from": ["human"], "value": "Hi"}, "from"),
        ({"from": {"name": "human"}, "value": "Hi"}, "from"),
        ({"role": ["user"], "content": "Hi"}, "role"),  # SpecForge's OpenAI turns under 'conversations'
    ],
)
@pytest.mark.parametrize("expect", ["prompt", "conversation"])
def test_a_sharegpt_speaker_that_is_not_a_string_is_named_with_its_file_and_line(tmp_path, turn, key, expect):
    bad = {"conversations": [turn, {"from": "gpt", "value": "Hello"}]}
    path = _write_jsonl(tmp_path / "chats.jsonl", [GOOD, bad])
    with pytest.raises(DataFormatError) as err:
        load_conversations([path], expect=expect)
    assert str(err.value).startswith(f"{path}, line 2: turn 1 has {key!r} ")
    assert "valid values" in str(err.value)
    # with skip_invalid the row is skipped and counted, the good row kept
    result = load_conversations([path], expect=expect, skip_invalid=True)
    assert [c.id for c in result.conversations] == ["chats-1"]
    assert [s.where for s in result.skipped] == [f"{path}, line 2"]
