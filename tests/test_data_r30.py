"""Review round 30 of answer regeneration and data loading.

- a larger recipe's regenerated file cut short (a copy) or ending in a blank line: training
  refused it ("rerun 'draftforge data regenerate' to rewrite it") and that rerun refused it in
  turn ("holds id ..., which is not among this run's prompts ... move it away"), though its whole
  rows answer every prompt of the run, as a whole larger file (accepted) does;
- a ``.json`` data file of one object on one line (JSON Lines with one row, which datasets reads
  as one row, and which the README's "one object a line" covers) was refused as "got dict; use
  .jsonl for one object per line", while the same file with two lines loaded.
"""

from __future__ import annotations

import gzip
import json

import pytest
from regenerate_helpers import SETTINGS, FakeEngine, make_prompts

from draftforge.data.loading import load_conversations
from draftforge.data.regenerate import check_answers, regenerate


@pytest.mark.parametrize("cut", ["inside the last row", "blank last line"])
def test_a_larger_file_cut_after_this_runs_rows_is_kept_not_refused(tmp_path, capsys, cut):
    big = tmp_path / "big.jsonl"
    regenerate(make_prompts(11), FakeEngine(), SETTINGS, big, progress=False)
    whole = big.read_bytes()
    lines = whole.splitlines(keepends=True)
    out = tmp_path / "copied.jsonl"
    out.write_bytes(whole[:-30] if cut == "inside the last row" else whole + b"\n")
    kept = lines[:-1] if cut == "inside the last row" else lines
    capsys.readouterr()
    engine = FakeEngine()
    report = regenerate(make_prompts(6), engine, SETTINGS, out, progress=False)
    err = capsys.readouterr().err
    assert engine.calls == []  # every prompt of this run was answered in the whole rows
    assert (report.num_generated, report.num_reused) == (0, 6)
    assert f"{out} ends with an incomplete line; rewriting it with its {len(kept)} whole rows" in err
    assert out.read_bytes() == b"".join(kept)  # the larger file's whole rows, as they were
    assert not out.with_name(out.name + ".partial").exists()
    check_answers(out, make_prompts(6), SETTINGS, "fake-target")  # training accepts it now
    # and the larger recipe continues it to the file it wrote
    regenerate(make_prompts(11), FakeEngine(), SETTINGS, out, progress=False)
    assert out.read_bytes() == whole


def test_a_larger_file_cut_before_this_runs_last_row_is_still_continued(tmp_path):
    """Cut inside this run's own rows: nothing beyond them survives, so it is continued as
    before (its whole rows kept, the cut batch answered again)."""
    reference = tmp_path / "ref.jsonl"
    regenerate(make_prompts(6), FakeEngine(), SETTINGS, reference, progress=False)
    big = tmp_path / "big.jsonl"
    regenerate(make_prompts(11), FakeEngine(), SETTINGS, big, progress=False)
    lines = big.read_bytes().splitlines(keepends=True)
    out = tmp_path / "copied.jsonl"
    out.write_bytes(b"".join(lines[:4]) + lines[4][:25])
    report = regenerate(make_prompts(6), FakeEngine(), SETTINGS, out, progress=False)
    assert (report.num_generated, report.num_reused) == (3, 3)
    assert out.read_bytes() == reference.read_bytes()


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
@pytest.mark.parametrize("ending", ["\n", "", "\r\n"])
def test_a_json_file_of_one_object_on_one_line_is_one_row(tmp_path, suffix, ending):
    row = {"id": "a", "prompt": "Hi", "system": "Be brief."}
    text = json.dumps(row) + ending
    path = tmp_path / f"one{suffix}"
    path.write_bytes(gzip.compress(text.encode()) if suffix.endswith(".gz") else text.encode())
    twin = tmp_path / "one.jsonl"
    twin.write_text(text)
    got = load_conversations([str(path)]).conversations
    assert [(c.id, c.messages, c.source) for c in got] == [
        ("a", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
         f"{path}, line 1"),
    ]
    assert [c.messages for c in got] == [c.messages for c in load_conversations([str(twin)]).conversations]


@pytest.mark.parametrize("text", [json.dumps({"id": "a", "prompt": "Hi"}, indent=2) + "\n",
                                  json.dumps({"data": [{"prompt": "Hi"}]}) + "\n"])
def test_a_json_file_of_one_object_that_is_no_row_line_is_still_refused(tmp_path, text):
    """A row over several lines is no JSON Lines; a wrapper object on one line is no row."""
    from draftforge.data.formats import DataFormatError

    path = tmp_path / "one.json"
    path.write_text(text)
    with pytest.raises(DataFormatError, match=r"must hold a list of row objects, got dict"):
        load_conversations([str(path)])
