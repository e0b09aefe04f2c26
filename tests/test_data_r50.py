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


def test_a_missing_relative_data_file_says_it_was_looked_for_from_the_current_directory(tmp_path, monkeypatch):
    """A recipe's relative train_files path is read from where the command runs, not from the
    recipe's folder: the error said only 'data file not found: mydata.jsonl'."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataFormatError) as info:
        load_conversations(["mydata.jsonl"])
    assert str(info.value) == (f"data file not found: mydata.jsonl (a relative path is read from the current "
                               f"directory, {tmp_path}); check data.train_files")


def test_a_one_layer_target_is_said_to_leave_the_draft_no_layer():
    from pathlib import Path

    from draftforge.config import load_recipe
    from draftforge.recipe_errors import RecipeError

    tiny = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    with pytest.raises(RecipeError) as info:
        load_recipe(tiny, ["target.shape.num_hidden_layers=1", "draft.target_layer_ids=[0]"])
    assert "a target of one layer has none: the draft needs a layer before the final one" in str(info.value)
    assert "0..-1" not in str(info.value)
