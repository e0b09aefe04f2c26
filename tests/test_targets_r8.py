"""Round 8 of the target engine's review: the SmolLM2 cache's durability and its lock, target
folders given with ``~``, and the messages for target folders that cannot be used."""

from __future__ import annotations

import fcntl
import json
import os
import re
import threading
from pathlib import Path

import pytest

from draftforge.config import load_recipe
from draftforge.errors import InputError
from draftforge.splitserve import placement, smollm2
from draftforge.splitserve import target as target_module
from draftforge.splitserve.config import TargetConfig, TargetShape
from draftforge.splitserve.random_target import random_llama
from draftforge.splitserve.registry import resolve_target_shape, rope_theta_problem
from draftforge.splitserve.target import build_target, load_tokenizer

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"


def _fake_conversion(monkeypatch, tmp_path):
    """A fake GGUF whose 'conversion' writes each required file holding its own name."""
    source = tmp_path / "fake.gguf"
    source.write_bytes(b"gguf")
    monkeypatch.setattr(smollm2, "gguf_path", lambda: source)

    def convert(_source, out):
        for name in smollm2._REQUIRED_FILES:
            (out / name).write_text(name)

    monkeypatch.setattr(smollm2, "_convert", convert)


def test_conversion_reaches_the_disk_before_it_is_renamed_into_place(monkeypatch, tmp_path):
    """is_converted() trusts any folder at the final name, so its files (and the folder's
    entries) must be fsynced before the rename, and the rename itself after it: otherwise
    a power loss can leave a "finished" conversion of empty files, loaded ever after."""
    _fake_conversion(monkeypatch, tmp_path)
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", Path(src), Path(dst)))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    cache = tmp_path / "cache"
    final = smollm2.ensure_smollm2(cache)

    renames = [i for i, event in enumerate(events) if event[0] == "rename" and event[2] == final]
    assert len(renames) == 1
    (at,) = renames
    tmp = events[at][1]
    synced_before = {event[1] for event in events[:at] if event[0] == "fsync"}
    assert {tmp / name for name in smollm2._REQUIRED_FILES} | {tmp} <= synced_before
    assert ("fsync", cache) in events[at + 1 :]  # the rename itself is made durable


TINY = {"num_hidden_layers": 3, "hidden_size": 32, "vocab_size": 48, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64}


def weights_only_folder(path):
    """A model folder as ``model.save_pretrained`` alone leaves it: config and weights, no tokenizer."""
    random_llama(TargetShape(**TINY), seed=1).save_pretrained(path, safe_serialization=True)
    return path


def test_a_folder_without_a_tokenizer_names_the_folder_and_what_is_missing(tmp_path):
    """transformers' own error blamed a missing sentencepiece install and named no folder."""
    folder = weights_only_folder(tmp_path / "final")
    cfg = TargetConfig(model=str(folder), dtype="float32")
    expected = rf"target folder {folder} has no tokenizer \(none of tokenizer.json, "
    with pytest.raises(InputError, match=expected):
        build_target(cfg, [0])
    with pytest.raises(InputError, match=expected):
        load_tokenizer(cfg)


def test_load_tokenizer_of_a_remote_code_folder_is_an_input_error(tmp_path):
    """load_tokenizer (the trainer's bigram initialisation) refused remote code with a bare
    ValueError; build_target already said which setting to change."""
    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "mycustom", "architectures": ["MyForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_my.MyConfig",
                     "AutoModelForCausalLM": "modeling_my.MyForCausalLM"}, **TINY}))  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_my.MyTokenizer", None]}}))
    with pytest.raises(InputError, match="set target.trust_remote_code: true only if you trust"):
        load_tokenizer(TargetConfig(model=str(folder)))


@pytest.mark.parametrize(("text", "problem"), [
    ('{"model_type": "llama",\n "hidden_size": 64,,}', r"is not valid JSON \(Expecting property name "
                                                       r"enclosed in double quotes: line 2 column 20\)"),
    ("[1, 2]", "holds a JSON list, not an object"),
])  # fmt: skip
def test_a_broken_config_json_names_the_file_and_the_place(tmp_path, text, problem):
    """build_target (and eval --target) read the folder's config.json for its shape first:
    a truncated or hand-edited one raised json's bare "Expecting ..." with no file named."""
    folder = weights_only_folder(tmp_path / "model")
    (folder / "config.json").write_text(text)
    with pytest.raises(InputError, match=re.escape(str(folder / "config.json")) + " " + problem):
        build_target(TargetConfig(model=str(folder), dtype="float32"), [0])


def test_a_model_without_llama_style_layers_is_an_input_error(tmp_path):
    """A GPT-2 folder (``transformer.h``, ``ln_f``) loads in transformers but has no layers to
    hook: refused input (the command's exit 2 with the message), not a ValueError traceback."""
    from tokenizers import Tokenizer, models
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    folder = tmp_path / "gpt2"
    config = GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=48, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(48)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w1")),
                            eos_token="w0").save_pretrained(folder)
    with pytest.raises(InputError, match="target model class GPT2LMHeadModel is not supported: "
                                         r"draftforge takes features from model.get_decoder\(\).layers"):
        build_target(TargetConfig(model=str(folder), dtype="float32"), [0])


def test_a_process_waiting_for_the_conversion_lock_says_so(monkeypatch, tmp_path, capsys):
    """Another process holding the lock (converting, or stopped mid-conversion) kept every
    other one waiting without a word."""
    _fake_conversion(monkeypatch, tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    lock = cache / f"{smollm2.NAME}.lock"
    results = []
    with open(lock, "a+") as holder:
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX)  # the other process
        waiter = threading.Thread(target=lambda: results.append(smollm2.ensure_smollm2(cache)))
        waiter.start()
        waiter.join(timeout=2)
        assert waiter.is_alive() and not results  # it waits for the holder ...
        assert f"waiting for {lock}: another process is converting SmolLM2" in capsys.readouterr().err
        fcntl.flock(holder.fileno(), fcntl.LOCK_UN)
    waiter.join(timeout=30)
    assert results == [cache / smollm2.NAME]  # ... and converts once it is gone
    assert "waiting" not in capsys.readouterr().err


def test_a_target_folder_given_with_a_tilde_is_read_like_its_full_path(tmp_path, monkeypatch):
    """``target.model: ~/models/x`` loaded (the engine expands ``~``), but its shape was read
    from a literal "~" folder: unknown, so the draft got no RoPE base and ``draftforge train``
    refused it, saying the config.json that is there "cannot be read here"."""
    monkeypatch.setenv("HOME", str(tmp_path))
    folder = tmp_path / "final"  # the shape recipes/tiny-debug.yaml's draft fits
    shape = TargetShape(num_hidden_layers=4, hidden_size=64, vocab_size=49152, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=2048)
    random_llama(shape, seed=1).save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text("{}")  # present: load_tokenizer's folder check passes
    absolute = resolve_target_shape(TargetConfig(model=str(folder)), strict=True)
    assert absolute is not None and absolute.rope_theta == 10000.0
    assert resolve_target_shape(TargetConfig(model="~/final"), strict=True) == absolute
    cfg = load_recipe(RECIPE, ["target.model=~/final", "target.shape=null"])
    assert rope_theta_problem(cfg) is None
    assert cfg.draft.rope_theta == 10000.0
    # the tokenizer is read from the expanded folder, not from a literal "~" one
    read = []

    def tokenizer_from(where, _cfg):
        read.append(where)
        return "the tokenizer"

    monkeypatch.setattr(target_module, "folder_tokenizer", tokenizer_from)
    assert load_tokenizer(TargetConfig(model="~/final")) == "the tokenizer"
    assert [str(where) for where in read] == [str(folder)]

    # a target split over GPUs: the placement plan reads the config from the expanded folder
    planned = []

    def plan(where, _spread, _cfg):
        planned.append(where)
        raise InterruptedError("planned")

    monkeypatch.setattr(placement, "plan_device_map", plan)
    with pytest.raises(InterruptedError):
        build_target(TargetConfig(model="~/final", dtype="float32"), [0], placement=object())
    assert [str(where) for where in planned] == [str(folder)]
