"""Round 10, files the user keeps: an interrupted run leaves the earlier good output whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from regenerate_helpers import SETTINGS, FakeEngine, Interrupted, make_prompts

from draftforge.data.regenerate import regenerate
from draftforge.errors import InputError
from draftforge.eval import llamacpp
from draftforge.eval.llamacpp_check import main as llamacpp_check_main


def _regenerate(out, n, engine=None):
    return regenerate(make_prompts(n), engine or FakeEngine(), SETTINGS, out, progress=False)


def test_an_interrupted_extension_keeps_the_finished_file(tmp_path):
    """Extending a finished answers file to more prompts and stopping part way left no file
    at <out>: training then found none (and answered the prompts live) and a rerun for the
    old prompts refused the .partial's new ids. The file stays until the new one replaces it."""
    reference = tmp_path / "ref.jsonl"
    _regenerate(reference, 11)
    out = tmp_path / "r.jsonl"
    _regenerate(out, 6)
    finished = out.read_bytes()
    partial = tmp_path / "r.jsonl.partial"
    # batches of 3: the extension answers batch 2 (p06-p08, calls 1-2: p06 has a follow-up),
    # then stops in batch 3
    try:
        _regenerate(out, 11, FakeEngine(fail_on_call=3))
    except Interrupted:
        pass
    assert out.read_bytes() == finished
    held = [line.split(b'"id": "')[1][:3] for line in partial.read_bytes().splitlines()]
    assert held == [b"p00", b"p01", b"p02", b"p03", b"p04", b"p05", b"p06", b"p07", b"p08"]
    # the old prompts: answered by the finished file, which stays as it was
    engine = FakeEngine()
    report = _regenerate(out, 6, engine)
    assert (report.num_reused, report.num_generated, engine.calls) == (6, 0, [])
    assert out.read_bytes() == finished
    # the extension continues from its .partial and ends as an uninterrupted run would
    report = _regenerate(out, 11)
    assert (report.num_reused, report.num_generated) == (9, 2)
    assert out.read_bytes() == reference.read_bytes() and not partial.exists()


def test_an_extension_stopped_before_its_first_batch_leaves_no_partial(tmp_path):
    out = tmp_path / "r.jsonl"
    _regenerate(out, 6)
    finished = out.read_bytes()
    try:
        _regenerate(out, 11, FakeEngine(fail_on_call=1))
    except Interrupted:
        pass
    assert out.read_bytes() == finished and not (tmp_path / "r.jsonl.partial").exists()


def test_llamacpp_json_that_cannot_be_written_is_refused_before_any_work(tmp_path):
    """--json was first written after the llama.cpp build, both conversions and the first
    prompt's decoding: a folder or a path under a file failed only then."""
    missing = str(tmp_path / "no-export")  # nothing else is looked at first
    with pytest.raises(InputError, match=rf"--json {tmp_path}: is a folder; .*{tmp_path}/llamacpp.json"):
        llamacpp_check_main([missing, "--recipe", "unread.yaml", "--json", str(tmp_path)])
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError, match=rf"--json .*file/out.json: {tmp_path}/file is a file, not a folder"):
        llamacpp_check_main([missing, "--recipe", "unread.yaml", "--json", str(tmp_path / "file" / "out.json")])


# the child: everything before the conversions stubbed, a conversion that writes its GGUF and waits
_CONVERTING = textwrap.dedent("""
    import sys, time, types
    from pathlib import Path
    import draftforge.config as config
    import draftforge.train.hf_load as hf_load
    from draftforge.eval import llamacpp, llamacpp_check

    class Target:
        trust_remote_code = False  # the recipe's default: folders of data only are converted

        def model_copy(self, update):
            return self

    hf_load.read_serving_config = lambda folder: {}
    hf_load.config_from_serving = lambda serving, where: types.SimpleNamespace(
        enable_confidence_head=False, markov_head_type="vanilla", confidence_head_with_markov=True)
    config.load_recipe = lambda path: types.SimpleNamespace(target=Target())
    llamacpp_check._target_folder = lambda target_cfg: Path(sys.argv[1])

    def convert(source, model_dir, out_file, *, target_dir=None):
        Path(out_file).write_bytes(b"GGUF" * 1024)
        print("written:", out_file, flush=True)
        time.sleep(120)

    llamacpp.convert = convert
    llamacpp_check.main([sys.argv[1], "--recipe", "unread.yaml", "--llama-cpp", sys.argv[2]])
""")


def test_llamacpp_check_stopped_by_sigterm_removes_its_gguf_folder(tmp_path):
    """SIGTERM (timeout(1), a scheduler) killed 'eval llamacpp' without unwinding: its
    temporary folder, holding the f32 GGUF of the target (4 bytes a parameter), stayed."""
    export, source, scratch = tmp_path / "export", tmp_path / "llama.cpp", tmp_path / "tmp"
    for path in (export / "config.json", source / llamacpp.CONVERTER,
                 source / "build" / "bin" / llamacpp.TOOL, source / "build" / "bin" / llamacpp.TOKENIZER):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    scratch.mkdir()
    child = subprocess.Popen([sys.executable, "-c", _CONVERTING, str(export), str(source)],
                             env=dict(os.environ, TMPDIR=str(scratch)), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not lines or not lines[-1].startswith("written:"):  # the target's GGUF is on disk
            line = child.stdout.readline()
            if not line:  # the child ended: its stderr says why
                child.kill()
                pytest.fail("".join(lines) + child.stderr.read())
            lines.append(line)
        assert [p.name[:7] for p in scratch.iterdir() for p in p.iterdir()] == ["target-"]
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 128 + signal.SIGTERM
    assert "draftforge eval llamacpp: stopped on SIGTERM" in err
    assert list(scratch.iterdir()) == []
