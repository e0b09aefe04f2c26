"""Session 58: ``continued_threads`` reads another run's file before this run's lock.

It looked for ``<out>.partial`` and then opened it; a run finishing in between renames its
``.partial`` to ``<out>``, and the open raised FileNotFoundError: a traceback (exit 1) for a
run started beside another, where the lock would have refused it cleanly.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftforge.data.regenerate import continued_threads

ARITHMETIC = {"device": "cpu", "backend": "hf", "dtype": "bfloat16"}


def test_a_partial_renamed_between_the_look_and_the_read_is_read_as_the_finished_file(tmp_path, monkeypatch):
    out = tmp_path / "answers.jsonl"
    out.write_text(json.dumps({"id": "a", "arithmetic": dict(ARITHMETIC, threads=2)}) + "\n")
    partial = out.with_name(out.name + ".partial")  # gone: the other run renamed it to out
    real_is_file = Path.is_file
    monkeypatch.setattr(Path, "is_file", lambda self: True if self == partial else real_is_file(self))
    assert continued_threads(out, ARITHMETIC) == (out, 2)


def test_the_partial_is_read_first_and_other_arithmetic_continues_nothing(tmp_path):
    out = tmp_path / "answers.jsonl"
    out.write_text(json.dumps({"id": "a", "arithmetic": dict(ARITHMETIC, threads=2)}) + "\n")
    partial = out.with_name(out.name + ".partial")
    partial.write_text(json.dumps({"id": "b", "arithmetic": dict(ARITHMETIC, threads=1)}) + "\n")
    assert continued_threads(out, ARITHMETIC) == (partial, 1)
    partial.write_text(json.dumps({"id": "b", "arithmetic": dict(ARITHMETIC, dtype="float16", threads=1)}) + "\n")
    assert continued_threads(out, ARITHMETIC) is None  # the partial decides; it is another run's
