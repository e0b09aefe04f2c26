"""Session 50: a jsonl line's JSON error gives its column on that line, in plain words."""

from __future__ import annotations

import pytest

from draftforge.data.formats import DataFormatError
from draftforge.data.loading import load_conversations


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "ok"', "line 2: invalid JSON: Expecting ',' delimiter (column 16)"),
    ('{"prompt": "abc', "line 2: invalid JSON: a string is not closed (no ending quote) starting at (column 12)"),
])
def test_a_jsonl_lines_json_error_is_located_on_that_line(tmp_path, line, message):
    """The line break was parsed with the line, so an error at its end read 'column 1' (of the
    line after), and a string left open read 'Invalid control character'."""
    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": "a", "prompt": "fine"}\n' + line + "\n")
    with pytest.raises(DataFormatError) as info:
        load_conversations([str(path)])
    assert message in str(info.value)
