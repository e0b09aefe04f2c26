"""`draftforge eval` and `draftforge demo` (review round 30): the --prompts-file reader."""

from __future__ import annotations

import json
import os
import threading

import pytest
from test_evalcli_r11 import recipe_path, tiny_export  # noqa: F401  (fixtures)

from draftforge.errors import InputError


def _write_rows(path, rows):
    # ensure_ascii=False: the characters as they are, as a script writing UTF-8 JSONL puts them
    path.write_text("\n".join(json.dumps(row, ensure_ascii=False) for row in rows) + "\n", encoding="utf-8")


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85"])
def test_a_prompts_file_row_holding_a_unicode_line_separator_is_one_row(tmp_path, separator):
    """JSON allows U+2028, U+2029 and NEL raw inside a string, and JSONL ends a row at "\\n"
    only; str.splitlines cut the row there, refused a valid file ("not JSON") and numbered
    every later line wrongly."""
    from draftforge.eval.cli import _prompts_from_file

    path = tmp_path / "prompts.jsonl"
    _write_rows(path, [
        {"workload": "w", "input_ids": [5, 6, 7], "text": f"first{separator}second"},
        {"workload": "w", "input_ids": [8, 9]},
        {"workload": f"v{separator}x", "input_ids": [10]},
    ])  # fmt: skip
    workloads, lines = _prompts_from_file(str(path), None)
    assert workloads == {"w": [[5, 6, 7], [8, 9]], f"v{separator}x": [[10]]}
    assert lines == {"w": [1, 2], f"v{separator}x": [3]}
    # a bad row after it is named by its own line, the one an editor shows
    with path.open("a", encoding="utf-8") as handle:
        handle.write('{"workload": "w", "input_ids": [1, -4]}\n')
    with pytest.raises(InputError, match=r"prompts\.jsonl:4: token id -4 is negative"):
        _prompts_from_file(str(path), None)


def test_a_prompts_file_row_nested_too_deeply_is_named_not_a_traceback(tmp_path):
    from draftforge.eval.cli import _prompts_from_file

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"workload": "w", "input_ids": [1]}) + "\n" + "[" * 100_000 + "\n")
    with pytest.raises(InputError, match=r"prompts\.jsonl:2: .*nested too deeply"):
        _prompts_from_file(str(path), None)


def test_a_prompts_file_given_as_a_pipe_is_read_and_a_folder_is_named(tmp_path):
    """--prompts-file <(make_prompts) or /dev/stdin is a pipe, not a regular file: it was
    refused as "no such file" although it exists; a folder was called missing too."""
    from draftforge.eval.cli import main

    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)

    def feed():
        with open(fifo, "w") as handle:  # blocks until the command opens it for reading
            handle.write('{"workload": "w", "input_ids": [1, 2]}\nnot json\n')

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    base = ["draft", "--target", "smollm2-135m-instruct", "--out", str(tmp_path / "out")]
    try:
        with pytest.raises(InputError) as refused:  # its second row, read from the pipe
            main([*base, "--prompts-file", str(fifo)])
    finally:
        if writer.is_alive():  # never opened for reading: let the writer go
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(timeout=10)
    assert f"{fifo}:2: not JSON" in str(refused.value)

    with pytest.raises(InputError, match="is a folder"):
        main([*base, "--prompts-file", str(tmp_path)])
    with pytest.raises(InputError, match="no such file"):
        main([*base, "--prompts-file", str(tmp_path / "missing.jsonl")])



def test_an_out_folder_that_is_the_export_itself_is_refused_before_the_target_loads(
        recipe_path, tiny_export, tmp_path, monkeypatch):  # noqa: F811
    """`draftforge eval EXPORT --out EXPORT` wrote report.md, report.json and two PNGs among the
    export's weights; a later `draftforge export` into that folder then refused it as not an
    export. Refused at once, the export untouched and no target built."""
    import draftforge.splitserve.target as target_module
    from draftforge.eval.cli import main

    before = sorted(p.name for p in tiny_export.iterdir())
    loaded = []
    monkeypatch.setattr(target_module, "build_target", lambda *a, **k: loaded.append(1))
    same = tiny_export.parent / "." / tiny_export.name  # the same folder, spelt otherwise
    with pytest.raises(InputError, match="is the draft being evaluated"):
        main([str(tiny_export), "--recipe", str(recipe_path), "--out", str(same)])
    assert sorted(p.name for p in tiny_export.iterdir()) == before and loaded == []
