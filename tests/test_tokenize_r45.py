"""Review round 45: conversation formats and loss masks (data/formats, data/tokenize).

The expected tokens are computed as a server sees a turn: the prompt (the conversation up to
the generation prompt) tokenised alone, then the ids of what the target generated.
"""

from __future__ import annotations

import pytest
from test_tokenize_r11 import QWEN3_PLAIN

from draftforge.data.formats import Conversation, DataFormatError, RowLocation, parse_row
from draftforge.data.tokenize import ChatTemplateError, tokenize_conversations, tokenize_messages

WHERE = RowLocation("train.jsonl", 3)
CALL = [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]


@pytest.mark.parametrize("turns", [
    [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Let me check.", "tool_calls": CALL}],
    [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": CALL}],
    [{"role": "user", "content": "Weather?"},
     {"role": "assistant", "content": "Checking.", "function_call": {"name": "weather", "arguments": "{}"}}],
])
@pytest.mark.parametrize("key", ["messages", "conversations"])
def test_an_assistant_turn_holding_a_tool_call_is_refused_for_training(turns, key):
    """Only role and content reach the chat template: "Let me check." was trained as the whole
    reply, teaching the draft to end the turn where the target calls a tool, without a word."""
    with pytest.raises(DataFormatError) as err:
        parse_row({key: turns}, WHERE, default_id="x", expect="conversation")
    assert str(err.value).startswith("train.jsonl, line 3: ")
    noun = "message" if key == "messages" else "turn"
    assert f"{noun} 2 (assistant) holds {next(k for k in turns[1] if 'call' in k)!r}" in str(err.value)
    # prompts: the target writes new replies, the old ones (and their calls) are dropped
    conv = parse_row({key: turns}, WHERE, default_id="x", expect="prompt")
    assert conv.messages == [{"role": "user", "content": "Weather?"}]


@pytest.mark.parametrize("none", [None, []])
def test_a_null_or_empty_tool_call_list_is_no_tool_call(none):
    row = {"messages": [{"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello", "tool_calls": none}]}
    assert parse_row(row, WHERE, default_id="x", expect="conversation").messages[1] == {
        "role": "assistant", "content": "Hello"}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from draftforge.splitserve import smollm2

    return AutoTokenizer.from_pretrained(smollm2.ensure_smollm2())


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.integration
@pytest.mark.parametrize("cut", ["<think>\nLet me think about", "<think>\nFirst, 2 + 2", "<think>\n好的，用户问"])
def test_a_last_reply_cut_inside_qwen3_reasoning_follows_the_served_prompt(tok, cut):
    """Thinking on, the target generated "<think>\\n..." after "<|im_start|>assistant\\n" and was
    cut before "</think>". Qwen3's template renders that reply after an empty reasoning block
    of its own ("<think>\\n\\n</think>\\n\\n<think>\\n..."), which the sample kept as context the
    target never saw while generating the supervised tokens."""
    messages = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": cut}]
    kwargs = {"chat_template": QWEN3_PLAIN, "enable_thinking": True}
    served = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True, **kwargs)
    assert served.endswith("<|im_start|>assistant\n")
    expected = _ids(tok, served) + _ids(tok, cut)  # the prompt, then what the target generated

    ids, mask = tokenize_messages(tok, messages, unfinished_turns=(1,), **kwargs)
    assert ids[: len(expected)] == expected, tok.convert_ids_to_tokens(ids)
    assert mask[: len(expected)] == [0] * len(_ids(tok, served)) + [1] * len(_ids(tok, cut))
    assert sum(mask) == len(_ids(tok, cut))  # the end-of-turn marker after it was never generated

    # a finished reply and a reply cut after its reasoning are unchanged: the rendering holds them
    for reply in ("<think>\nhm\n</think>\n\nFour.", "<think>\nhm\n</think>\n\nFo"):
        whole = tok.apply_chat_template([*messages[:1], {"role": "assistant", "content": reply}],
                                        tokenize=False, **kwargs)
        assert whole == served + reply + "<|im_end|>\n"
        ids, mask = tokenize_messages(tok, [*messages[:1], {"role": "assistant", "content": reply}],
                                      unfinished_turns=(1,) if reply.endswith("Fo") else (), **kwargs)
        generated = _ids(tok, reply) + ([] if reply.endswith("Fo") else _ids(tok, "<|im_end|>"))
        assert ids[: len(_ids(tok, served)) + len(generated)] == _ids(tok, served) + generated
        assert [i for i, m in zip(ids, mask, strict=True) if m] == generated


@pytest.mark.integration
def test_a_reply_with_reasoning_under_thinking_off_names_the_thinking_setting(tok):
    """Qwen3's thinking-off prompt ends with an empty reasoning block, so a reply holding its
    own cannot follow it: the error blamed the template ("use a template that keeps the prompt
    unchanged") where the data and target.generation.enable_thinking disagree."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello"}]
    with pytest.raises(ChatTemplateError) as err:
        tokenize_conversations([Conversation("c7", messages, source="train.jsonl, line 7")], tok,
                               max_length=64, min_loss_tokens=1, chat_template=QWEN3_PLAIN)
    message = str(err.value)
    assert message.startswith("train.jsonl, line 7 (id 'c7'): message 2 (assistant) ")
    assert "target.generation.enable_thinking: true" in message and "reasoning block" in message
    # with thinking on it trains, as the target writes it
    samples, _ = tokenize_conversations([Conversation("c7", messages)], tok, max_length=64,
                                        min_loss_tokens=1, chat_template=QWEN3_PLAIN, enable_thinking=True)
    assert len(samples) == 1
