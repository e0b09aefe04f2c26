"""How ``draftforge.eval.llamacpp`` reports llama.cpp's tools failing, hanging or being interrupted.

The tools are stood in for by small scripts (in a folder whose name has a space) that behave as
llama.cpp 0.3.36's do where it matters here: ``ggml_abort`` (``ggml/src/ggml.c``) prints the
``GGML_ASSERT`` message to stderr and then, unless ``GGML_NO_BACKTRACE`` is set, a backtrace
(gdb's where installed) before it aborts; ``--log-disable`` pauses the log, which then discards
every message, errors included (``common/log.cpp``, ``common_log::add``).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftforge.errors import InputError
from draftforge.eval import llamacpp

ASSERT = "llama-model.cpp:2041: GGML_ASSERT(ggml_nelements(cur) == n_embd * n_vocab) failed"


def _tool(bin_dir: Path, name: str, body: str) -> None:
    """An executable ``bin_dir/name`` running the Python ``body``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / name
    path.write_text(f"#!{sys.executable}\nimport os, sys, time\n{body}")
    path.chmod(0o755)


def _aborting(message: str) -> str:
    """ggml_abort: the message, the backtrace unless GGML_NO_BACKTRACE is set, then SIGABRT."""
    return (
        f"sys.stderr.write({message + chr(10)!r})\n"
        "if not os.environ.get('GGML_NO_BACKTRACE'):\n"
        "    for i in range(30):\n"
        "        sys.stderr.write(f'#{i}  0x00007f{i:08x} in ggml_abort () from libggml-base.so\\n')\n"
        "sys.stderr.flush()\n"
        "os.abort()\n"
    )


def test_an_abort_while_loading_is_reported_with_its_assert_message(tmp_path):
    bin_dir = tmp_path / "llama cpp" / "bin"
    _tool(bin_dir, llamacpp.TOOL, "sys.stderr.write('0.00.100.000 I main: loading\\n')\n" + _aborting(ASSERT))
    with pytest.raises(InputError) as failure:
        llamacpp.run_speculative(bin_dir, tmp_path / "t.gguf", tmp_path / "d.gguf", "P", max_new_tokens=4,
                                 block_size=4, timeout_s=60)  # fmt: skip
    assert f"{llamacpp.TOOL} failed (exit -6)" in str(failure.value)
    assert ASSERT in str(failure.value)  # the reason, not the last frames of a backtrace


def test_a_tokenizer_failure_says_why(tmp_path):
    bin_dir = tmp_path / "llama cpp" / "bin"
    _tool(
        bin_dir, llamacpp.TOKENIZER,
        "if '--log-disable' not in sys.argv:\n"
        "    sys.stderr.write(\"llama_model_load: error loading model: tensor 'token_embd.weight' has wrong shape\\n\")\n"
        "    sys.stderr.write(\"error: could not load model from file 'target.gguf'.\\n\")\n"
        "sys.exit(1)\n",
    )  # fmt: skip
    with pytest.raises(InputError, match=r"llama-tokenize failed \(exit 1\) on .*target.gguf: .*wrong shape .*could not"):
        llamacpp.tokenize(bin_dir, tmp_path / "target.gguf", "P")


def test_the_tokenizer_reads_the_ids_beside_its_log(tmp_path):
    bin_dir = tmp_path / "llama cpp" / "bin"
    _tool(
        bin_dir, llamacpp.TOKENIZER,
        "sys.stderr.write('llama_model_loader: loaded meta data with 31 key-value pairs\\n[0]\\n')\n"
        "assert open(sys.argv[sys.argv.index('-f') + 1]).read() == 'a b\\n'\n"
        "print('[1, 22, 333]')\n",
    )  # fmt: skip
    assert llamacpp.tokenize(bin_dir, tmp_path / "t.gguf", "a b\n") == [1, 22, 333]


def test_a_run_past_its_timeout_is_killed_and_says_how_far_it_got(tmp_path):
    bin_dir = tmp_path / "llama cpp" / "bin"
    rounds = "".join(
        f"0.00.{i}00.000 D accepted {i}/4 draft tokens, the last target token is: ({100 + i})\\n" for i in range(3)
    )
    _tool(bin_dir, llamacpp.TOOL, f"sys.stderr.write('{rounds}'); sys.stderr.flush()\ntime.sleep(120)\n")
    start = time.monotonic()
    with pytest.raises(InputError) as failure:
        llamacpp.run_speculative(bin_dir, tmp_path / "t.gguf", tmp_path / "d.gguf", "P", max_new_tokens=4,
                                 block_size=4, timeout_s=2)  # fmt: skip
    assert time.monotonic() - start < 60  # killed at the timeout, not waited for
    message = str(failure.value)
    assert "ran past 2 s on one prompt, after 3 rounds" in message
    assert "accepted 2/4 draft tokens, the last target token is: (102)" in message


def test_an_interrupted_conversion_leaves_no_partial_gguf(tmp_path, monkeypatch):
    def interrupted(command, **kwargs):
        Path(command[command.index("--outfile") + 1]).write_bytes(b"GGUF" + bytes(64))  # half written
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess, "run", interrupted)
    out_dir = tmp_path / "work dir"
    with pytest.raises(KeyboardInterrupt):
        llamacpp.convert(tmp_path, tmp_path / "export", out_dir / "draft-f32.gguf")
    assert list(out_dir.iterdir()) == []


class _Reached(Exception):
    pass


@pytest.mark.parametrize("confidence_head", [False, True])
def test_p_min_with_a_draft_without_a_confidence_head_is_refused_up_front(tmp_path, monkeypatch, confidence_head):
    from eval_helpers import draft_config

    from draftforge.eval import llamacpp_check
    from draftforge.train.export import export_draft
    from draftforge.train.model import DSparkDraft

    overrides = {} if confidence_head else dict(enable_confidence_head=False, confidence_head_with_markov=False)
    export = export_draft(DSparkDraft(draft_config(**overrides)), tmp_path / "export", progress=lambda _: None)

    def reached(cfg):  # the target: what comes after the arguments are checked (and converts for minutes)
        raise _Reached

    monkeypatch.setattr(llamacpp_check, "_target_folder", reached)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-cpu.yaml"
    args = [str(export), "--recipe", str(recipe), "--p-min", "0.2"]
    if confidence_head:
        with pytest.raises(_Reached):
            llamacpp_check.main(args)
    else:
        with pytest.raises(InputError, match=r"--p-min 0\.2: .*config\.json has no confidence head"):
            llamacpp_check.main(args)
        with pytest.raises(_Reached):
            llamacpp_check.main([str(export), "--recipe", str(recipe)])  # full blocks need no head


# two lines as llama.cpp 0.3.36 logs SmolLM2's vocabulary: <|im_end|> ends the turn, and
# <|endoftext|> ends generation too, though SmolLM2's generation config lists only the former
END_TOKENS = """0.00.059.176 I print_info: EOG token             = 0 '<|endoftext|>'
0.00.059.177 I print_info: EOG token             = 2 '<|im_end|>'
"""
STATS = """0.00.849.128 D accepted 1/4 draft tokens, the last target token is: (7)
0.08.269.938 I encoded    3 tokens in    0.179 seconds, speed:  229.330 t/s
0.08.269.940 I n_predict = 2
0.08.269.940 I n_drafted = 4
0.08.269.940 I n_accept  = 1
"""


def test_parse_run_reads_the_tokens_llamacpp_ends_generation_on():
    run = llamacpp.parse_run("\n\nP\nfh\n\n\n\n", END_TOKENS + END_TOKENS + STATS, "P\n")  # target, then draft
    assert run.end_tokens == {0, 2}
    assert llamacpp.parse_run("\n\nP\nfh\n\n\n\n", STATS, "P\n").end_tokens == set()


def test_the_replay_stops_where_llamacpp_stops(tmp_path, monkeypatch):
    """draftforge's side decodes on until a token llama.cpp's vocabulary ends on, not only the
    target's own end-of-turn ids: else a <|endoftext|> would read as a difference."""
    from test_llamacpp import _fake_check

    from draftforge.eval import llamacpp_check
    from draftforge.eval.llamacpp_check import Replay

    args, _ = _fake_check(tmp_path, monkeypatch, InputError("unused"))
    run = llamacpp.parse_run("\n\nP\nfh\n\n\n\n", END_TOKENS + STATS, "P\n")
    monkeypatch.setattr(llamacpp, "run_speculative", lambda *a, **kw: run)
    stops = []

    def replay(*args, eos, **kw):
        stops.append(eos)
        return Replay(3, 2, 4, 1, [5, 7], [(1, 4, 7)], target_margins=[1.0], draft_margins=[1.0])

    monkeypatch.setattr(llamacpp_check, "replay", replay)
    assert llamacpp_check.main(args) == 0
    assert stops == [{0, 2}, {0, 2}]  # the fake target's end of turn (0) and llama.cpp's (0, 2)
