"""Session 51: 'draftforge data regenerate' does not replace a file that holds no regenerated row."""

from __future__ import annotations

import pytest
from regenerate_helpers import SETTINGS, FakeEngine, make_prompts

from draftforge.data.regenerate import RegenerationError, regenerate


@pytest.mark.parametrize("text", ["important notes line one\n", "{not json either\n",
                                  "important notes without a final newline", '{"precious": 1}'])
def test_a_file_without_one_regenerated_row_is_refused_not_replaced(tmp_path, text):
    """A one-line text file named as data.regenerated_file was taken for a regenerated file whose
    last write was cut ("continuing from its whole rows": none), deleted and replaced by answers.
    The same line followed by another was refused all along."""
    out = tmp_path / "notes.jsonl"
    out.write_text(text)
    with pytest.raises(RegenerationError, match=r"line 1: not a regenerated row .* not written by 'draftforge data regenerate'"):
        regenerate(make_prompts(3), FakeEngine(), SETTINGS, out, progress=False)
    assert out.read_text() == text
