"""``check_mask_token``: the draft's MASK id must be a token the target's text never contains.

Checked against SmolLM2-135M-Instruct's real tokenizer: ids 0-16 are its special tokens,
1 and 2 are ``<|im_start|>`` / ``<|im_end|>`` (ChatML), 16 is ``<empty_output>``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from draftforge.errors import InputError
from draftforge.splitserve.target import check_mask_token

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from draftforge.splitserve import smollm2

    return AutoTokenizer.from_pretrained(smollm2.ensure_smollm2())


def test_the_cpu_recipes_mask_token_is_accepted_and_named(tokenizer):
    note = check_mask_token(tokenizer, 16, vocab_size=49152, eos_ids=[2])
    assert "'<empty_output>'" in note and "special token" in note


def test_an_ordinary_text_token_is_refused_with_usable_ids(tokenizer):
    text_id = tokenizer("hello", add_special_tokens=False)["input_ids"][0]
    with pytest.raises(InputError) as info:
        check_mask_token(tokenizer, text_id, vocab_size=49152, eos_ids=[2])
    message = str(info.value)
    assert f"draft.mask_token_id {text_id} is {tokenizer.convert_ids_to_tokens(text_id)!r}" in message
    assert "ordinary text token" in message
    suggested = [int(x) for x in message.rsplit("[", 1)[1].rstrip("]").split(",")]
    assert suggested and 1 not in suggested and 2 not in suggested
    for token_id in suggested:  # every suggestion passes the check itself
        check_mask_token(tokenizer, token_id, vocab_size=49152, eos_ids=[2])


def test_a_chat_template_marker_is_refused(tokenizer):
    with pytest.raises(InputError, match=r"1 is '<\|im_start\|>', which the chat template writes"):
        check_mask_token(tokenizer, 1, vocab_size=49152, eos_ids=[2])


@pytest.fixture()
def untemplated():
    """SmolLM2's tokenizer without a chat template of its own, as a base model's."""
    from transformers import AutoTokenizer

    from draftforge.splitserve import smollm2

    tokenizer = AutoTokenizer.from_pretrained(smollm2.ensure_smollm2())
    template, tokenizer.chat_template = tokenizer.chat_template, None
    return tokenizer, template


def test_the_recipes_chat_template_is_the_one_checked(untemplated):
    # the data is rendered with target.generation.chat_template: its markers are refused
    tokenizer, template = untemplated
    with pytest.raises(InputError, match=r"1 is '<\|im_start\|>', which the chat template writes"):
        check_mask_token(tokenizer, 1, vocab_size=49152, eos_ids=[2], chat_template=template)
    assert "special token" in check_mask_token(tokenizer, 16, vocab_size=49152, eos_ids=[2],
                                               chat_template=template)  # fmt: skip


def test_no_chat_template_at_all_is_refused(untemplated):
    tokenizer, _ = untemplated
    with pytest.raises(InputError, match="no chat template and target.generation.chat_template is not set"):
        check_mask_token(tokenizer, 16, vocab_size=49152, eos_ids=[2])


def test_both_thinking_settings_are_rendered(tokenizer):
    # id 16 (<empty_output>) appears only when thinking is on: serving may turn it on
    template = ("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
                "{% if add_generation_prompt and enable_thinking %}<empty_output>{% endif %}")  # fmt: skip
    for thinking in (False, True):
        with pytest.raises(InputError, match=r"16 is '<empty_output>', which the chat template writes"):
            check_mask_token(tokenizer, 16, vocab_size=49152, eos_ids=[2], chat_template=template,
                             enable_thinking=thinking)  # fmt: skip
    broken = "{{ raise_exception('no such role') }}"
    with pytest.raises(InputError, match="target.generation.chat_template renders no short chat"):
        check_mask_token(tokenizer, 16, vocab_size=49152, eos_ids=[2], chat_template=broken)


def test_an_end_of_turn_id_is_refused(tokenizer):
    with pytest.raises(InputError, match="end-of-turn token of the target"):
        check_mask_token(tokenizer, 2, vocab_size=49152, eos_ids=[2])


def test_ids_outside_the_vocabulary_and_past_the_tokenizer(tokenizer):
    with pytest.raises(InputError, match="outside the target's vocabulary of 49152"):
        check_mask_token(tokenizer, 49152, vocab_size=49152, eos_ids=[2])
    # an embedding larger than the tokenizer (as Qwen3's 151,936 rows over 151,669 tokens)
    note = check_mask_token(tokenizer, 49160, vocab_size=49200, eos_ids=[2])
    assert "past the tokenizer's 49152 tokens" in note


def _engine_for(recipe: str, overrides: list[str]):
    """``roles.build_engine`` for a recipe, on CPU, without a process group."""
    from types import SimpleNamespace

    import torch

    from draftforge.config import load_recipe
    from draftforge.splitserve.roles import build_engine

    cfg = load_recipe(ROOT / "recipes" / recipe, overrides)
    logged: list[str] = []
    ctx = SimpleNamespace(cfg=cfg, device=torch.device("cpu"), log=logged.append)
    threads = torch.get_num_threads()
    try:
        return build_engine(ctx), logged
    finally:
        torch.set_num_threads(threads)


def test_the_target_rank_refuses_a_text_token_as_mask_for_a_trained_target():
    engine, logged = _engine_for("smollm2-cpu.yaml", [])
    assert engine.trained and any("<empty_output>" in line for line in logged)
    with pytest.raises(InputError, match="ordinary text token"):
        _engine_for("smollm2-cpu.yaml", ["draft.mask_token_id=1000"])


def test_a_random_target_skips_the_mask_check():
    # id 1 is <|im_start|>, which the check refuses for a trained target (above); a random
    # target's ids carry no usage, so the target rank must not refuse it.
    engine, logged = _engine_for("tiny-debug.yaml", ["draft.mask_token_id=1"])
    assert not engine.trained
    assert not any("mask_token_id" in line for line in logged)
