"""JSON that parses into what Python refuses (review round 62): an integer literal of more than
4,300 digits raises a plain ValueError, and arrays nested thousands deep a RecursionError. The
data loader caught neither the first nor, in the regenerated answers' readers, the second: a
traceback naming no file or line, and data.skip_invalid did not skip the row."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from regenerate_helpers import SETTINGS, FakeEngine, make_prompts

from draftforge.data.loading import DataFormatError, load_conversations
from draftforge.data.regenerate import (
    RegenerationError,
    check_answers,
    continued_threads,
    regenerate,
)

HUGE = "1" * 5000  # past Python's int-string conversion limit (4,300 digits)
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("name,body,line", [
    ("rows.jsonl", '{"prompt": "hello"}\n{"prompt": "hi", "score": ' + HUGE + "}\n", "line 2"),
    ("rows.json", '[{"prompt": "hello"},\n {"prompt": "hi", "score": ' + HUGE + "}]\n", None),
])
def test_an_integer_python_cannot_convert_is_an_invalid_row_named_by_file(tmp_path, name, body, line):
    path = tmp_path / name
    path.write_text(body)
    with pytest.raises(DataFormatError) as refused:
        load_conversations([str(path)])
    message = str(refused.value)
    assert str(path) in message and "invalid JSON" in message and "4300" in message, message
    if line is not None:
        assert line in message
        # a row like any other invalid one: skipped where the recipe says so
        assert len(load_conversations([str(path)], skip_invalid=True).conversations) == 1


def test_regenerated_answers_nested_too_deeply_are_refused_naming_the_line(tmp_path):
    out = tmp_path / "regenerated.jsonl"
    prompts = make_prompts(3)
    with contextlib.redirect_stderr(io.StringIO()):
        regenerate(prompts, FakeEngine(), SETTINGS, out, progress=False)
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join([lines[0], DEEP + "\n", *lines[1:]]))  # not the last line, which reads as cut
    rows = 1
    for read in (lambda: check_answers(out, prompts, SETTINGS, "fake-target"),
                 lambda: regenerate(prompts, FakeEngine(), SETTINGS, out, progress=False)):
        with pytest.raises(RegenerationError, match=rf"{out}, line {rows + 1}: not a regenerated row \(maximum "
                                                    "recursion depth exceeded"), \
                contextlib.redirect_stderr(io.StringIO()):
            read()
    # the threads reader skips what it cannot read, as it skips a cut line
    assert continued_threads(Path(out), {"device": "cpu", "backend": "hf", "dtype": "bfloat16"}) is None


def test_compare_refuses_a_report_it_cannot_read_naming_it(tmp_path):
    from draftforge.errors import InputError
    from draftforge.eval.compare import load_report

    for body in ('{"methods": ' + HUGE + "}", DEEP):
        (tmp_path / "report.json").write_text(body)
        with pytest.raises(InputError, match=f"{tmp_path / 'report.json'}: not a readable report"):
            load_report(str(tmp_path))


def test_eval_refuses_a_prompts_file_row_it_cannot_read_naming_its_line(tmp_path):
    from draftforge.errors import InputError
    from draftforge.eval.cli import _prompts_from_file

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"workload": "w", "input_ids": [1, 2]}) + "\n"
                    + '{"workload": "w", "input_ids": [' + HUGE + "]}\n")
    with pytest.raises(InputError, match=f"{path}:2: not a prompt row \\(Exceeds the limit"):
        _prompts_from_file(str(path), None)
