"""Review round 21 of the data modules: repeated rows in a finished answers file, the line of
a refused answer, invalid UTF-8 in a .json file, the overlap check's progress and its missing
workload packages."""

from __future__ import annotations

import gzip
import json
import re

import pytest
from regenerate_helpers import SETTINGS, FakeEngine, make_prompts
from splitserve_helpers import tiny_recipe

from draftforge.data import overlap, workloads
from draftforge.data import regenerate as regen
from draftforge.data.config import DataConfig
from draftforge.data.formats import Conversation, DataFormatError
from draftforge.data.loading import load_conversations, load_prompts
from draftforge.data.overlap import check_no_overlap, eval_index
from draftforge.data.regenerate import RegenerationError, check_answers, regenerate


def _finished(tmp_path, n=7):
    prompts = make_prompts(n)
    out = tmp_path / "regenerated.jsonl"
    regenerate(prompts, FakeEngine(), SETTINGS, out, progress=False)
    return prompts, out


def test_a_finished_file_repeating_a_row_is_rewritten_once_not_called_finished(tmp_path, capsys):
    # training refuses a file answering one id twice ("id ... is already used"), so a rerun of
    # 'data regenerate' that called it finished left the user no way forward
    prompts, out = _finished(tmp_path)
    whole = out.read_bytes()
    lines = whole.splitlines(keepends=True)
    out.write_bytes(whole + lines[2] + lines[5])  # concatenated with part of itself
    with pytest.raises(RegenerationError, match=re.escape(f"{out}, line 8: repeats line 3 word for word")):
        check_answers(out, prompts, SETTINGS, FakeEngine.name)
    engine = FakeEngine()
    report = regenerate(prompts, engine, SETTINGS, out, progress=False)
    assert (report.num_generated, engine.calls) == (0, [])
    assert "repeats rows word for word; rewriting it with each row once" in capsys.readouterr().err
    assert out.read_bytes() == whole
    check_answers(out, prompts, SETTINGS, FakeEngine.name)
    assert [c.id for c in load_conversations([str(out)], expect="conversation").conversations] == [
        p.id for p in prompts]


def test_a_finished_file_with_a_second_different_answer_is_refused_with_both_lines(tmp_path):
    prompts, out = _finished(tmp_path)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    other = dict(rows[1], messages=[*rows[1]["messages"][:-1],
                                    {"role": "assistant", "content": "another answer"}])
    out.write_text(out.read_text() + json.dumps(other) + "\n")
    for call in (lambda: regenerate(prompts, FakeEngine(), SETTINGS, out, progress=False),
                 lambda: check_answers(out, prompts, SETTINGS, FakeEngine.name)):
        with pytest.raises(RegenerationError, match=re.escape(
                f"{out}, line 8: a second, different answer to id 'p01' (the first is on line 2")):
            call()


@pytest.mark.parametrize("where", ["finished", "partial"])
def test_an_answer_written_with_other_settings_is_refused_with_its_line(tmp_path, where):
    prompts, out = _finished(tmp_path)
    if where == "partial":
        out = out.rename(out.with_name(out.name + ".partial"))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    rows[4]["generation"] = dict(rows[4]["generation"], temperature=1.0)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RegenerationError, match=re.escape(
            f"{out}, line 5 (id 'p04') was written with other target.generation settings "
            "(temperature: file 1.0, this run 0.7)")):
        regenerate(prompts, FakeEngine(), SETTINGS, tmp_path / "regenerated.jsonl", progress=False)


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_invalid_utf8_in_a_json_file_names_its_line_and_column(tmp_path, suffix):
    payload = b'[\n {"prompt": "tea"},\n {"prompt": "caf\xe9"}\n]\n'
    path = tmp_path / f"prompts{suffix}"
    path.write_bytes(gzip.compress(payload) if suffix.endswith(".gz") else payload)
    with pytest.raises(DataFormatError, match=re.escape(f"{path}, line 3: invalid UTF-8 at column 17")):
        load_conversations([str(path)])
    # a byte-order mark still opens the file, and a good file still loads
    path.write_bytes(b"\xef\xbb\xbf" + payload.replace(b"\xe9", "\u00e9".encode()))
    if suffix.endswith(".gz"):
        path.write_bytes(gzip.compress(path.read_bytes()))
    assert [c.user_turns for c in load_conversations([str(path)]).conversations] == [
        ["tea"], ["caf\u00e9"]]


def _conversations(n=3):
    return [Conversation(f"c{i}", [{"role": "user", "content": f"Plan a picnic for {i} friends."}])
            for i in range(n)]


def test_the_overlap_check_shows_its_progress_unless_told_not_to(tmp_path, monkeypatch, capsys):
    # minutes for a large training set: a bar once it runs a while (here at once)
    monkeypatch.setattr(overlap, "PROGRESS_DELAY_S", 0.0, raising=False)
    check_no_overlap(_conversations())
    assert re.search(r"overlap check: 100%.*3/3", capsys.readouterr().err)
    check_no_overlap(_conversations(), progress=False)
    assert "overlap check" not in capsys.readouterr().err
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": m.user_turns[0]}) + "\n" for m in _conversations()))
    load_prompts(DataConfig(train_files=[str(data)], regenerate=True), progress=False)
    assert "overlap check" not in capsys.readouterr().err


def test_data_regenerate_no_progress_silences_the_overlap_check_too(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(overlap, "PROGRESS_DELAY_S", 0.0, raising=False)
    recipe = tiny_recipe(tmp_path, num_conversations=4,
                         overrides={"data.regenerate": True, "data.overlap_check": True})
    assert regen.main([str(recipe), "--workers", "1", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "4 prompts: 4 answered now" in err and "overlap check" not in err
    assert regen.main([str(recipe), "--workers", "1"]) == 0
    assert re.search(r"overlap check: 100%.*4/4", capsys.readouterr().err)


def test_a_missing_workload_package_says_the_overlap_check_needs_it(monkeypatch):
    # 'data regenerate' evaluates nothing: a bare "workload 'mtbench' needs ..." left the user
    # guessing why, and at which setting
    monkeypatch.setitem(workloads._PACKAGES, "mtbench",
                        ("draftforge_no_such_package", "pip install no-such-package", "q.jsonl"))
    eval_index.cache_clear()
    try:
        with pytest.raises(workloads.WorkloadUnavailableError) as err:
            check_no_overlap(_conversations(), threshold=0.5)
    finally:
        eval_index.cache_clear()
    assert str(err.value).startswith(
        "data.overlap_check compares the training data with the evaluation workloads "
        "(humaneval, mtbench, gsm8k) so that none is trained on; workload 'mtbench' needs the "
        "Python package 'draftforge_no_such_package'")
    assert "pip install no-such-package" in str(err.value)


def test_a_sigterm_landing_in_a_finalizer_still_stops_a_worker_quietly(tmp_path):
    """A regenerate worker got the parent's SIGTERM while the garbage collector ran a library
    object's __del__ (regex's Group): the SystemExit its handler raised there was printed as
    "Exception ignored ... Traceback" and lost, the worker went on. The exit is now asked again
    once the finalizer has returned."""
    import subprocess
    import sys

    script = tmp_path / "worker.py"
    script.write_text(
        "import os, signal, time\n"
        "from draftforge.data.answer_workers import _exit_cleanly\n"
        "signal.signal(signal.SIGTERM, _exit_cleanly)\n"
        "class Finalised:\n"
        "    def __del__(self):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecode: in here\n"
        "        total = 0\n"
        "        for i in range(10000):\n"
        "            total += i\n"
        "try:\n"
        "    Finalised()\n"
        "    time.sleep(5)\n"
        "    print('not stopped', flush=True)\n"
        "except SystemExit as stop:\n"
        "    print('stopped', stop.code, flush=True)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.stdout == "stopped 143\n", done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr
