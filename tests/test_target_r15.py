"""Round 15 of the target engines: model folders whose weights are incomplete, damaged or of
another model are refused with the file and the weights named (not loaded partly random),
and generation with a tokenizer whose pad token has no embedding row."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_target_capture import CHAT_TEMPLATE, tiny_tokenizer

from draftforge.errors import InputError
from draftforge.splitserve.config import GenerationConfig, TargetConfig, TargetShape
from draftforge.splitserve.random_target import random_llama
from draftforge.splitserve.target import build_target

SHAPE = TargetShape(num_hidden_layers=4, hidden_size=64, vocab_size=40, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=96)


def word_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """A word-level chat tokenizer of SHAPE.vocab_size tokens."""
    return tiny_tokenizer(SHAPE.vocab_size, chat_template)


def llama_folder(path: Path, tokenizer=None, shape: TargetShape = SHAPE, **save) -> Path:
    random_llama(shape, seed=1).save_pretrained(path, safe_serialization=True, **save)
    (tokenizer or word_tokenizer()).save_pretrained(path)
    return path


def load(folder: Path):
    return build_target(TargetConfig(model=str(folder), dtype="float32"), [0])


# ------------------------------------------------------------------ weights the folder lacks


def test_a_folder_missing_a_weight_is_refused_not_initialised_at_random(tmp_path):
    folder = llama_folder(tmp_path / "target")
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InputError) as err:
        load(folder)
    assert str(err.value) == (
        f"target folder {folder}: its safetensors files lack 1 of the weights config.json's "
        "LlamaForCausalLM needs (model.layers.1.mlp.down_proj.weight); transformers would "
        "initialise them at random. A shard may be missing, or the weights are of another model "
        "than config.json's"
    )


def test_a_base_model_without_its_lm_head_is_refused(tmp_path):
    """A folder saved from the bare decoder (``LlamaModel``: an embedding model, say) under a
    causal-LM config: the untied lm_head would be random, and so every generated reply."""
    folder = llama_folder(tmp_path / "target")
    weights = load_file(folder / "model.safetensors")
    assert "lm_head.weight" in weights
    del weights["lm_head.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"lack 1 of the weights .*\(lm_head\.weight\)"):
        load(folder)


def test_weights_of_another_shape_than_the_config_name_the_folder(tmp_path):
    folder = llama_folder(tmp_path / "target")
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 50)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InputError, match=(
            rf"^target folder {folder}: some weights in its safetensors files have other shapes "
            r"than its config.json gives them")):
        load(folder)


# --------------------------------------------------------- weights files that cannot be read


def test_a_git_lfs_pointer_in_place_of_the_weights_is_named_with_the_fix(tmp_path):
    folder = llama_folder(tmp_path / "target")
    (folder / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "4d" * 32 + "\nsize 538090408\n")
    with pytest.raises(InputError) as err:
        load(folder)
    message = str(err.value)
    assert message.startswith(f"target folder {folder}: model.safetensors is not a readable "
                              "safetensors file (")
    assert message.endswith("it is a Git LFS pointer, not the weights: fetch them with "
                            "`git lfs pull` in that folder")


def test_a_weights_file_cut_short_is_named(tmp_path):
    folder = llama_folder(tmp_path / "target", max_shard_size="50KB")
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) > 2
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError) as err:
        load(folder)
    message = str(err.value)
    assert message.startswith(f"target folder {folder}: {shards[1].name} is not a readable "
                              "safetensors file (")
    assert message.endswith("it is damaged or cut short (an interrupted download or copy?): "
                            "fetch it again")


def test_a_shard_the_index_names_but_the_folder_lacks_is_named(tmp_path):
    folder = llama_folder(tmp_path / "target", max_shard_size="50KB")
    shards = sorted(folder.glob("*.safetensors"))
    shards[2].unlink()
    with pytest.raises(InputError) as err:
        load(folder)
    assert str(err.value) == (
        f"target folder {folder}: model.safetensors.index.json names 1 weights file(s) the folder "
        f"does not have ({shards[2].name}); the download or copy is incomplete"
    )


# ------------------------------------------------------------------------------- padding


def test_a_pad_token_without_an_embedding_row_still_left_pads_a_batch(tmp_path):
    """A pad token added to the tokenizer without resizing the embedding (id 40 of 40 rows):
    the prompts hold no such id, only the padding would; a batch of prompts of different
    lengths generates what each prompt generates alone."""
    tokenizer = word_tokenizer()
    tokenizer.add_special_tokens({"pad_token": "<extra_pad>"})
    assert tokenizer.pad_token_id == SHAPE.vocab_size
    target = load(llama_folder(tmp_path / "target", tokenizer))
    conversations = [[{"role": "user", "content": "w1 w2 w3 w4 w5 w6"}],
                     [{"role": "user", "content": "w7"}]]
    settings = GenerationConfig(temperature=0, max_new_tokens=5, batch_size=2)
    batched = target.generate_token_ids(conversations, settings)
    alone = target.generate_token_ids(conversations, settings.model_copy(update={"batch_size": 1}))
    assert batched == alone
    assert all(len(reply) > 0 for reply in batched)


# ------------------------------------------------------------------------ the target's context


def test_a_prompt_whose_reply_could_outrun_the_context_is_refused_as_sglang_does(tmp_path):
    """``max_position_embeddings`` 32: a prompt of 25 tokens (20 words and the template's 5
    markers) may take 7 new tokens, not 8; past the context a RoPE model answers from
    positions it never saw, and the draft would learn those answers."""
    short = SHAPE.model_copy(update={"max_position_embeddings": 32})
    folder = tmp_path / "target"
    random_llama(short, seed=1).save_pretrained(folder, safe_serialization=True)
    word_tokenizer().save_pretrained(folder)
    target = load(folder)
    conversations = [[{"role": "user", "content": "w1"}],
                     [{"role": "user", "content": " ".join(["w2"] * 20)}]]
    settings = GenerationConfig(temperature=0, max_new_tokens=7, batch_size=2)
    replies = target.generate_token_ids(conversations, settings)
    assert [len(reply) for reply in replies] == [7, 7]  # this random target ends neither reply
    with pytest.raises(InputError) as err:
        target.generate(conversations, settings.model_copy(update={"max_new_tokens": 8}))
    assert str(err.value) == (
        "target 'target': the prompt of conversation 1 has 25 tokens: with "
        "target.generation.max_new_tokens 8, it and its reply could take 33 positions, more than "
        "the target's max_position_embeddings 32; shorten or leave out that prompt, or lower "
        "max_new_tokens"
    )


# ------------------------------------------------------------------- tokenizer files


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_tokenizer_file_that_is_not_json_is_named_with_its_line(tmp_path, name):
    from draftforge.splitserve.target import load_tokenizer

    folder = llama_folder(tmp_path / "target")
    (folder / name).write_text('{\n  "version": "1.0",\n  truncated')
    expected = (f"{folder / name} is not valid JSON (Expecting property name enclosed in double "
                "quotes: line 3 column 3)")
    with pytest.raises(InputError) as err:
        load(folder)
    assert str(err.value) == expected
    with pytest.raises(InputError) as err:  # data preparation reads it without the weights
        load_tokenizer(TargetConfig(model=str(folder), dtype="float32"))
    assert str(err.value) == expected


def test_a_git_lfs_pointer_in_place_of_tokenizer_json_is_named_with_the_fix(tmp_path):
    folder = llama_folder(tmp_path / "target")
    (folder / "tokenizer.json").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "ab" * 32 + "\nsize 7031673\n")
    with pytest.raises(InputError) as err:
        load(folder)
    assert str(err.value) == (
        f"{folder / 'tokenizer.json'} is not valid JSON (Expecting value: line 1 column 1); it is "
        "a Git LFS pointer, not the file: fetch it with `git lfs pull` in that folder"
    )


# ----------------------------------------------------------------------------- config.json


def test_a_config_without_a_model_type_is_an_input_error_naming_the_folder(tmp_path):
    """Was transformers' bare ValueError with a traceback (a config.json written by hand, or
    one of another library, such as a GGUF converter's, without ``model_type``)."""
    import json

    import transformers

    folder = llama_folder(tmp_path / "target")
    config = json.loads((folder / "config.json").read_text())
    del config["model_type"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError) as err:
        load(folder)
    assert str(err.value) == (
        f"target folder {folder}: transformers {transformers.__version__} cannot load it as a causal "
        f"language model (Unrecognized model in {folder}. Should have a `model_type` key in its "
        "config.json.); draftforge needs a decoder-only LM with Llama-style layers (check "
        "config.json's model_type, or upgrade transformers for a newer architecture)"
    )
