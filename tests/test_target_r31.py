"""Round 31 of the transformers target backend: end-of-turn ids that only config.json lists,
and a sharded weights folder that lacks its index file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_target_capture import CHAT_TEMPLATE
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from draftforge.errors import InputError
from draftforge.splitserve.config import GenerationConfig, TargetConfig, TargetShape
from draftforge.splitserve.random_target import random_llama
from draftforge.splitserve.target import (
    build_target,
    check_mask_token_in_folder,
    folder_eos_ids,
)

SHAPE = TargetShape(num_hidden_layers=3, hidden_size=32, vocab_size=40, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=64)
EOT, EOM = 3, 7  # <|im_end|> (the tokenizer's eos) and <|eom|>, a second end-of-turn token


def eom_tokenizer():
    """A word-level chat tokenizer whose specials include ``<|eom|>`` (id 7), which a plain chat
    does not contain: an end-of-turn id of a model that lists it only in config.json."""
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "<|eom|>"]
    words += [f"w{i}" for i in range(SHAPE.vocab_size - len(words))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<|eom|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def folder_with_config_eos(path: Path, *, generation_eos: object = "absent") -> Path:
    """A random Llama folder whose config.json lists [EOT, EOM] as eos_token_id; its
    generation_config.json is removed ("absent") or lists ``generation_eos``."""
    random_llama(SHAPE, seed=2).save_pretrained(path, safe_serialization=True)
    eom_tokenizer().save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = [EOT, EOM]
    (path / "config.json").write_text(json.dumps(config))
    generation = path / "generation_config.json"
    if generation_eos == "absent":
        generation.unlink(missing_ok=True)
    else:
        generation.write_text(json.dumps({"eos_token_id": generation_eos}))
    return path


# ------------------------------------------------------------------ end-of-turn ids of config.json


def test_a_folder_without_generation_config_ends_turns_where_transformers_does(tmp_path):
    """transformers builds the generation config of a folder without generation_config.json
    from config.json (its eos_token_id included), and SGLang always adds config.json's
    eos_token_id to its stop ids: the folder's eos (the SGLang backend's and the pre-load
    mask check's) must hold them as the transformers backend's do."""
    from transformers import AutoModelForCausalLM

    folder = folder_with_config_eos(tmp_path / "merged")
    stops = AutoModelForCausalLM.from_pretrained(str(folder)).generation_config.eos_token_id
    assert set(stops) == {EOT, EOM}  # transformers' own stopping ids (independent of draftforge)
    engine = build_target(TargetConfig(model=str(folder), dtype="float32"), [0])
    assert set(engine.eos_token_ids()) >= set(stops)
    assert set(folder_eos_ids(engine.tokenizer, folder)) >= set(stops)


def test_a_mask_token_that_config_json_makes_an_end_of_turn_id_is_refused_before_loading(tmp_path):
    folder = folder_with_config_eos(tmp_path / "merged")
    cfg = TargetConfig(model=str(folder), dtype="float32")
    with pytest.raises(InputError, match="draft.mask_token_id 7 is an end-of-turn token"):
        check_mask_token_in_folder(cfg, EOM)


def test_both_backends_stop_at_config_json_eos_beside_generation_config(tmp_path):
    """SGLang (``ModelConfig._get_hf_eos_token_id``) stops at the union of config.json's and
    generation_config.json's eos_token_id: the transformers backend, which regenerates the
    data, and the SGLang backend's eos list agree with the serving engine on it."""
    folder = folder_with_config_eos(tmp_path / "target", generation_eos=EOT)
    union = {EOT, EOM}  # SGLang's rule, from the two files
    engine = build_target(TargetConfig(model=str(folder), dtype="float32"), [0])
    assert set(engine.eos_token_ids()) == union
    assert set(folder_eos_ids(engine.tokenizer, folder)) == union
    assert engine.eos_token_ids()[0] == EOT  # the tokenizer's eos stays first (the pad fallback)


def test_a_reply_ended_by_a_config_json_eos_is_cut_there_and_finished(tmp_path):
    folder = folder_with_config_eos(tmp_path / "target", generation_eos=EOT)
    engine = build_target(TargetConfig(model=str(folder), dtype="float32"), [0])
    # an output layer whose logits are its bias alone: <|eom|> is the greedy choice everywhere
    head = torch.nn.Linear(SHAPE.hidden_size, SHAPE.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[EOM] = 1.0
    engine.model.lm_head = head
    settings = GenerationConfig(temperature=0.0, max_new_tokens=5)
    conversation = [{"role": "user", "content": "w1 w2"}]
    assert engine.generate_token_ids([conversation], settings) == [[EOM]]
    (reply,) = engine.generate([conversation], settings)
    assert reply.finished


# ------------------------------------------------------------------ sharded weights without an index


def test_shards_without_their_index_file_are_named_with_the_fix(tmp_path):
    folder = tmp_path / "sharded"
    random_llama(SHAPE, seed=2).save_pretrained(folder, safe_serialization=True, max_shard_size="20KB")
    eom_tokenizer().save_pretrained(folder)
    (folder / "model.safetensors.index.json").unlink()
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 1
    with pytest.raises(InputError) as err:
        build_target(TargetConfig(model=str(folder), dtype="float32"), [0])
    message = str(err.value)
    assert str(folder) in message and "model.safetensors.index.json" in message
    assert shards[0] in message
