"""Target interface on tiny random models: capture indices, padding, loading, generation.

The same conventions are checked on the real SmolLM2 target in test_smollm2.py.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from draftforge.splitserve import hf_backend
from draftforge.splitserve.config import GenerationConfig, TargetConfig, TargetShape
from draftforge.splitserve.hf_backend import HFTarget
from draftforge.splitserve.random_target import random_llama
from draftforge.splitserve.target import (
    TargetEngine,
    build_target,
    check_layer_ids,
    load_tokenizer,
    render_prompt,
    sglang_layer_ids,
)

SHAPE = TargetShape(
    num_hidden_layers=5,
    hidden_size=64,
    vocab_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
)
LAYERS = [3, 0, 2]  # deliberately unsorted: concatenation follows the given order
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def random_cfg(**overrides) -> TargetConfig:
    fields = {"model": "random", "dtype": "float32", "shape": SHAPE, "seed": 3}
    fields.update(overrides)
    return TargetConfig(**fields)


@pytest.fixture(scope="module")
def target() -> HFTarget:
    return build_target(random_cfg(), LAYERS)


def reference_states(model, input_ids):
    """transformers' own hidden states (all layers materialised: the slow reference)."""
    with torch.no_grad():
        return model(input_ids, output_hidden_states=True)


def tiny_tokenizer(vocab_size: int = SHAPE.vocab_size, chat_template: str | None = CHAT_TEMPLATE):
    """A word-level chat tokenizer of ``vocab_size`` tokens ("w0", "w1", ... after the specials)."""
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def save_tiny_target(folder):
    """A random Llama plus a word-level chat tokenizer saved as a local HF folder ``folder``."""
    random_llama(SHAPE, seed=5).save_pretrained(folder, safe_serialization=True)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def local_folder(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("tiny-target"))


def test_targets_satisfy_protocol(target, local_folder):
    assert isinstance(build_target(TargetConfig(model=str(local_folder)), [0]), TargetEngine)
    assert (target.num_hidden_layers, target.hidden_size, target.vocab_size) == (5, 64, 48)


def test_captured_layer_i_is_hf_hidden_states_i_plus_1(target):
    input_ids = torch.randint(
        0, SHAPE.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0)
    )
    features = target.features(input_ids)
    hidden = reference_states(target.model, input_ids).hidden_states
    assert len(hidden) == SHAPE.num_hidden_layers + 1
    h = SHAPE.hidden_size
    assert features.aux.shape == (2, 9, len(LAYERS) * h)
    for slot, layer_id in enumerate(LAYERS):
        torch.testing.assert_close(
            features.aux[..., slot * h : (slot + 1) * h], hidden[layer_id + 1], rtol=0, atol=0
        )


def test_final_is_post_norm_state(target):
    model = target.model
    input_ids = torch.randint(
        0, SHAPE.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1)
    )
    final = target.features(input_ids).final
    out = reference_states(model, input_ids)
    # transformers ties hidden_states[-1] to the post-norm state for Llama ...
    torch.testing.assert_close(final, out.hidden_states[-1], rtol=0, atol=0)
    # ... and independently: run the last decoder layer by hand on hidden_states[L-1]
    # and apply RMSNorm by its formula.
    with torch.no_grad():
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
        before = out.hidden_states[-2]
        rotary = model.model.rotary_emb(before, position_ids=positions)
        pre_norm = model.model.layers[-1](
            before, attention_mask=None, position_embeddings=rotary, position_ids=positions
        )
        rms = torch.rsqrt(pre_norm.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps)
        manual = model.model.norm.weight * (pre_norm * rms)
        torch.testing.assert_close(final, manual, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(final, pre_norm, atol=1e-3)  # the norm really was applied
        torch.testing.assert_close(model.lm_head(final), out.logits, rtol=1e-5, atol=1e-5)


def test_hooks_are_removed_after_features(target):
    modules = [*target.model.model.layers, target.model.model.norm]
    before = [dict(module._forward_hooks) for module in modules]  # transformers may add its own
    target.features(torch.zeros(1, 3, dtype=torch.long))
    assert [dict(module._forward_hooks) for module in modules] == before


def test_right_padding_matches_unpadded_features(target):
    gen = torch.Generator().manual_seed(2)
    lengths = [7, 4, 1]
    rows = [torch.randint(0, SHAPE.vocab_size, (n,), generator=gen) for n in lengths]
    padded = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(padded)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = row
        mask[i, : len(row)] = 1
    batch = target.features(padded, mask)
    for i, row in enumerate(rows):
        alone = target.features(row.unsqueeze(0))
        n = len(row)
        torch.testing.assert_close(batch.aux[i, :n], alone.aux[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch.final[i, :n], alone.final[0], rtol=1e-5, atol=1e-5)
        assert batch.aux[i, n:].abs().sum() == 0 and batch.final[i, n:].abs().sum() == 0


def test_features_in_recipe_dtype():
    target = build_target(random_cfg(dtype="bfloat16"), [1])
    features = target.features(torch.zeros(1, 4, dtype=torch.long))
    assert features.aux.dtype == torch.bfloat16 and features.final.dtype == torch.bfloat16


def test_features_usable_in_autograd(target):
    """Features come from no_grad, not inference_mode: a trainer can build a graph on them."""
    features = target.features(torch.zeros(1, 4, dtype=torch.long))
    assert not features.aux.is_inference() and not features.final.is_inference()
    # plain data, outside any graph: a trainer's backward never reaches the target's weights
    assert not features.aux.requires_grad and not features.final.requires_grad
    weight = torch.ones(features.aux.shape[-1], requires_grad=True)
    (features.aux * weight).sum().backward()
    # d/dw sum_{b,s,d} aux[b,s,d] * w[d] = sum_{b,s} aux[b,s,d]
    torch.testing.assert_close(weight.grad, features.aux.sum(dim=(0, 1)), rtol=0, atol=0)
    assert all(p.grad is None for p in target.model.parameters())


@pytest.mark.parametrize(
    ("layer_ids", "message"),
    [
        ([4], "final decoder layer"),
        ([0, 4], "final decoder layer"),
        ([5], "outside 0..3"),
        ([-1], "outside 0..3"),
        ([1, 1], "repeated"),
        ([], "empty"),
    ],
)
def test_bad_layer_ids_refused(layer_ids, message):
    with pytest.raises(ValueError, match=message):
        check_layer_ids(layer_ids, SHAPE.num_hidden_layers)
    with pytest.raises(ValueError, match=message):
        build_target(random_cfg(), layer_ids)


def test_sglang_translation_is_documented_identity():
    assert sglang_layer_ids([1, 14, 27]) == [1, 14, 27]
    assert "before" in sglang_layer_ids.__doc__


def test_random_target_is_seeded():
    a = build_target(random_cfg(seed=7), [0]).embed_tokens_weight()
    b = build_target(random_cfg(seed=7), [0]).embed_tokens_weight()
    c = build_target(random_cfg(seed=8), [0]).embed_tokens_weight()
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_random_target_without_smollm2_vocab_has_no_generate(target):
    with pytest.raises(RuntimeError, match="features"):
        target.generate([[{"role": "user", "content": "hi"}]], GenerationConfig())


def test_head_and_embedding_shapes(target):
    assert target.lm_head_weight().shape == (SHAPE.vocab_size, SHAPE.hidden_size)
    assert target.embed_tokens_weight().shape == (SHAPE.vocab_size, SHAPE.hidden_size)
    assert not target.lm_head_weight().requires_grad


def test_sglang_backend_without_package_names_install_command():
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed; the missing-package message cannot be checked")
    from draftforge.errors import InputError

    with pytest.raises(InputError, match=r"pip install 'draftforge\[sglang\]'"):
        build_target(random_cfg(backend="sglang"), [0])


def test_declared_shape_checked_against_loaded_folder(local_folder):
    from draftforge.errors import InputError

    wrong = SHAPE.model_copy(update={"hidden_size": 128})
    with pytest.raises(InputError, match="target.shape.hidden_size"):
        build_target(TargetConfig(model=str(local_folder), dtype="float32", shape=wrong), [0])


def test_missing_folder_names_the_choices(tmp_path):
    """A user's input error: the draftforge command prints it without a traceback, exit 2."""
    from draftforge.errors import InputError

    with pytest.raises(InputError, match="registered name"):
        build_target(TargetConfig(model=str(tmp_path / "nope")), [0])


def test_bin_only_folder_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="safetensors only"):
        build_target(TargetConfig(model=str(tmp_path)), [0])


def test_threads_set_on_cpu(local_folder, monkeypatch):
    calls = []
    monkeypatch.setattr(hf_backend.torch, "set_num_threads", calls.append)
    build_target(TargetConfig(model=str(local_folder), dtype="float32", num_threads=1), [0])
    assert calls == [1]


def conversations():
    return [
        [{"role": "user", "content": "w1 w2 w3"}],
        [{"role": "system", "content": "w9"}, {"role": "user", "content": "w4"}],
    ]


def test_local_folder_greedy_generate_matches_hf(local_folder):
    engine = build_target(TargetConfig(model=str(local_folder), dtype="float32"), [1])
    settings = GenerationConfig(temperature=0.0, max_new_tokens=6)
    replies = engine.generate(conversations(), settings)
    tokenizer = engine.tokenizer
    for conversation, reply in zip(conversations(), replies, strict=True):
        prompt = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            out = engine.model.generate(
                **prompt,
                do_sample=False,
                max_new_tokens=6,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        expected = tokenizer.decode(
            out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True
        )
        assert reply == expected


def test_seeded_sampling_reproducible(local_folder):
    engine = build_target(TargetConfig(model=str(local_folder), dtype="float32"), [1])
    sample = GenerationConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12, seed=11)
    first = engine.generate(conversations(), sample)
    state = torch.random.get_rng_state()
    assert engine.generate(conversations(), sample) == first
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is untouched
    others = [
        engine.generate(conversations(), sample.model_copy(update={"seed": s}))
        for s in (12, 13, 14)
    ]
    assert any(other != first for other in others)


def test_chat_template_override_is_used(local_folder):
    engine = build_target(TargetConfig(model=str(local_folder), dtype="float32"), [1])
    seen = []
    override = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    original = engine.tokenizer.apply_chat_template

    def spy(*args, **kwargs):
        seen.append(kwargs.get("chat_template"))
        return original(*args, **kwargs)

    engine.tokenizer.apply_chat_template = spy
    engine.generate(
        conversations()[:1],
        GenerationConfig(temperature=0.0, max_new_tokens=2, chat_template=override),
    )
    assert seen == [override]


@pytest.mark.parametrize(
    ("conversation", "message"),
    [
        ([], "non-empty"),
        ([{"role": "user"}], "string 'role' and 'content'"),
        (
            [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}],
            "ends with role 'assistant'",
        ),
    ],
)
def test_bad_conversations_refused(local_folder, conversation, message):
    engine = build_target(TargetConfig(model=str(local_folder), dtype="float32"), [1])
    with pytest.raises(ValueError, match=message):
        engine.generate([conversation], GenerationConfig(temperature=0.0, max_new_tokens=2))


def test_load_tokenizer_without_weights(local_folder):
    from draftforge.errors import InputError

    tokenizer = load_tokenizer(TargetConfig(model=str(local_folder)))
    assert tokenizer.chat_template == CHAT_TEMPLATE
    with pytest.raises(InputError, match="features on token ids only"):
        load_tokenizer(random_cfg())


def test_generate_without_a_pad_token_left_pads_by_hand(local_folder):
    """Llama-3 and Mistral tokenizers have no pad token: batches are padded with an eos id."""
    engine = build_target(TargetConfig(model=str(local_folder), dtype="float32"), [1])
    engine.tokenizer.pad_token = None
    assert engine.tokenizer.pad_token_id is None
    settings = GenerationConfig(temperature=0.0, max_new_tokens=6, batch_size=2)
    prompts = [render_prompt(engine.tokenizer, c, i, settings) for i, c in enumerate(conversations())]
    lengths = {len(engine.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts}
    assert len(lengths) == 2  # the batch needs padding
    together = engine.generate_token_ids(conversations(), settings)
    alone = [engine.generate_token_ids([c], settings)[0] for c in conversations()]
    assert together == alone and all(together)


def test_a_template_that_refuses_a_conversation_is_a_chat_template_error(local_folder):
    from draftforge.data.tokenize import ChatTemplateError

    engine = build_target(TargetConfig(model=str(local_folder), dtype="float32"), [1])
    no_system = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                 "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }} "
                 "{% endfor %}")  # fmt: skip
    settings = GenerationConfig(temperature=0.0, max_new_tokens=2, chat_template=no_system)
    with pytest.raises(ChatTemplateError, match=r"fails on conversation 1 \(System role not supported\)"):
        engine.generate(conversations(), settings)


def weights_folder(path, seed: int):
    """A model folder named ``path`` holding a tiny random Llama drawn from ``seed``."""
    path.mkdir(parents=True)
    random_llama(SHAPE, seed=seed).save_pretrained(path, safe_serialization=True)
    return path


def test_target_name_tells_apart_folders_of_one_name(tmp_path):
    import shutil

    from draftforge.splitserve.target import target_name

    first = weights_folder(tmp_path / "sft-v1" / "final", seed=1)
    second = weights_folder(tmp_path / "sft-v2" / "final", seed=2)
    copy = shutil.copytree(first, tmp_path / "copy" / "final")
    names = [target_name(TargetConfig(model=str(folder))) for folder in (first, second, copy)]
    assert names == ["final"] * 3
    assert names[0].fingerprint != names[1].fingerprint
    assert names[0].fingerprint == names[2].fingerprint  # the same model wherever it lies
    assert target_name(TargetConfig(model=str(tmp_path / "nope"))).fingerprint is None
    seeded = [target_name(random_cfg(seed=s)) for s in (3, 3, 4)]
    assert seeded == ["random"] * 3
    assert seeded[0].fingerprint == seeded[1].fingerprint != seeded[2].fingerprint


def test_built_targets_carry_their_fingerprint(local_folder):
    from draftforge.splitserve.target import target_name

    for cfg in (TargetConfig(model=str(local_folder), dtype="float32"), random_cfg()):
        engine = build_target(cfg, [1])
        assert engine.name == target_name(cfg)
        assert engine.name.fingerprint == target_name(cfg).fingerprint is not None
