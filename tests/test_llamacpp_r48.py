"""llama.cpp helpers after a review (session 48): a converter that exits 0 without its GGUF,
and a tokenizer that hangs, are errors that name them (not a traceback, not a hang)."""

import sys
import time
from pathlib import Path

import pytest

from draftforge.errors import InputError
from draftforge.eval import llamacpp


def test_a_converter_that_exits_0_without_a_gguf_is_named(tmp_path):
    source = tmp_path / "llama.cpp"
    source.mkdir()
    (source / llamacpp.CONVERTER).write_text("import sys\nprint('nothing to do')\nsys.exit(0)\n")
    out = tmp_path / "out" / "draft.gguf"
    with pytest.raises(InputError, match="exited 0 on .* but wrote no GGUF"):
        llamacpp.convert(source, tmp_path / "model", out)
    assert not out.exists() and list(out.parent.iterdir()) == []  # its staging folder removed


def test_a_tokenizer_that_hangs_is_stopped(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / llamacpp.TOKENIZER
    tool.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(30)\n")
    tool.chmod(0o755)
    monkeypatch.setattr(llamacpp, "TOKENIZE_TIMEOUT_S", 1)
    start = time.monotonic()
    with pytest.raises(InputError, match="gave no ids within 1 s"):
        llamacpp.tokenize(bin_dir, Path("model.gguf"), "hello")
    assert time.monotonic() - start < 20


def test_a_prompt_llama_tokenize_fails_on_is_that_prompts_error(tmp_path, monkeypatch, capsys):
    """llama-tokenize ran outside the per-prompt handling: one failure ended the whole check as
    bad input (status 2), losing the prompts checked before it."""
    import json

    from test_llamacpp import _fake_check

    from draftforge.eval import llamacpp_check

    args, _ = _fake_check(tmp_path, monkeypatch, InputError("unused"))

    def tokenize(bin_dir, gguf, text):
        if text == "second":
            raise InputError("llama-tokenize failed (exit 1) on target.gguf: bad vocab")
        return [1, 2, 3]

    monkeypatch.setattr(llamacpp, "tokenize", tokenize)
    assert llamacpp_check.main(args) == 1
    records = json.loads((tmp_path / "out.json").read_text())
    assert [(r["index"], r["status"]) for r in records] == [(0, "agree"), (1, "error")]
    assert "bad vocab" in records[1]["detail"] and records[1]["same_tokenization"] is None
    assert "the draft's confidence head was not exercised" not in capsys.readouterr().out


def test_a_confidence_head_left_unexercised_is_said(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from test_llamacpp import _fake_check

    from draftforge.eval import llamacpp_check
    from draftforge.train import hf_load

    args, _ = _fake_check(tmp_path, monkeypatch, InputError("llama.cpp failed"))
    monkeypatch.setattr(hf_load, "config_from_serving", lambda cfg, where: SimpleNamespace(
        target_layer_ids=[0], block_size=4, enable_confidence_head=True, markov_head_type="vanilla",
        confidence_head_with_markov=True))
    llamacpp_check.main(args)
    assert "the draft's confidence head was not exercised (--p-min 0" in capsys.readouterr().out
