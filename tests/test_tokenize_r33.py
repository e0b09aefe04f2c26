"""Review round 33: loss masks checked against what a server sends and the target generates.

The expected tokens are computed here from the tokenizer and the chat template alone, as a
server sees a turn: the prompt (the conversation up to the generation prompt) tokenised
alone, then the ids of what the model generates (the text after the prompt up to the end
of the template's end-of-turn marker; for a reply cut at the generation limit, up to the
end of the reply). SmolLM2's real tokenizer (byte-level BPE, GPT-2's pre-tokenizer) is used
with small templates imitating ChatML, Llama-3, Gemma, Phi-3 and Mistral v0.3, whose
markers are added as special tokens as those models' tokenizers have them.
"""

from __future__ import annotations

import pytest
from test_tokenize_r11 import QWEN3_PLAIN

from draftforge.data.formats import Conversation
from draftforge.data.tokenize import tokenize_conversations, tokenize_messages

SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<start_of_turn>", "<end_of_turn>", "<bos>", "<|user|>", "<|assistant|>", "<|system|>",
           "<|end|>", "[INST]", "[/INST]", "<s>", "</s>"]
LLAMA3 = ("<|begin_of_text|>{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
          " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
GEMMA = ("<bos>{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
         "{% set msgs = messages[1:] %}{% else %}{% set first = '' %}{% set msgs = messages %}{% endif %}"
         "{% for m in msgs %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
         "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') + m['content'] | trim + '<end_of_turn>\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
PHI3 = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ '</s>' }}{% endif %}")
# Mistral v0.3's: no generation prompt, and a space before each reply ({{- " " + content|trim + eos_token }})
MISTRAL = ("<s>{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
           "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] | trim + '</s>' }}{% endif %}{% endfor %}")
TEMPLATES = {"chatml": (None, "<|im_end|>"), "llama3": (LLAMA3, "<|eot_id|>"), "gemma": (GEMMA, "<end_of_turn>"),
             "phi3": (PHI3, "<|end|>"), "mistral": (MISTRAL, "</s>")}
REPLIES = ["Hello!", "    return x", "\n\nHello", " x", "  spaced  ", "", "héllo 😀 世界", "line\n\n", "a\r\nb",
           "<think>\nhmm\n</think>\n\nok"]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from draftforge.splitserve import smollm2

    tokenizer = AutoTokenizer.from_pretrained(smollm2.ensure_smollm2())  # a copy of its own: tokens are added
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    return tokenizer


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def server_view(tok, messages, template, eot, unfinished=()) -> tuple[list[int], list[list[int]]]:
    """The first served prompt's ids, and for each assistant turn the ids the target generated."""
    kwargs = {"chat_template": template, "tokenize": False}
    generated = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tok.apply_chat_template(messages[:index], add_generation_prompt=True, **kwargs)
        turn = tok.apply_chat_template(messages[: index + 1], **kwargs)
        assert turn.startswith(prompt)
        after = turn[len(prompt):]
        if index in unfinished:  # up to the end of the reply's text, as the template renders it
            reply = message["content"] if message["content"] in after else message["content"].strip()
            assert not after[: after.index(reply)].strip()  # these templates put only whitespace before
            after = after[: after.index(reply) + len(reply)]
        else:
            after = after[: after.index(eot) + len(eot)]
        generated.append(_ids(tok, after))
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return _ids(tok, tok.apply_chat_template(messages[:first], add_generation_prompt=True, **kwargs)), generated


def check(tok, name, messages, unfinished=()):
    template, eot = TEMPLATES[name]
    ids, mask = tokenize_messages(tok, messages, chat_template=template, unfinished_turns=unfinished)
    prompt, generated = server_view(tok, messages, template, eot, unfinished)
    assert ids[: len(prompt)] == prompt, tok.convert_ids_to_tokens(ids[: len(prompt) + 2])
    assert mask[: len(prompt)] == [0] * len(prompt)
    supervised = [i for i, m in zip(ids, mask, strict=True) if m]
    assert supervised == [i for run in generated for i in run], tok.convert_ids_to_tokens(supervised)


@pytest.mark.integration
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_every_template_style_supervises_what_the_target_generates_after_the_served_prompt(tok, name):
    """Single and multi-turn conversations, with and without a system prompt, replies cut at
    the generation limit, leading/trailing whitespace, empty replies and unicode."""
    user = {"role": "user", "content": "Hi there"}
    for reply in REPLIES:
        for system in ([], [{"role": "system", "content": "Be brief."}]):
            messages = [*system, user, {"role": "assistant", "content": reply}]
            check(tok, name, messages)
            if reply.strip():
                check(tok, name, messages, unfinished=(len(messages) - 1,))
        check(tok, name, [user, {"role": "assistant", "content": reply},
                          {"role": "user", "content": "More"}, {"role": "assistant", "content": reply + " again"}])


@pytest.mark.integration
@pytest.mark.parametrize("reply", ["Hello!", "  x = 1", "\n\nok"])
@pytest.mark.parametrize("template", ["llama3", "qwen3-no-thinking"])
def test_a_generation_prompt_ending_in_a_blank_line_is_the_prompt_the_server_sends(tok, template, reply):
    """SmolLM2's pre-tokenizer reads "\\n\\n" as one token at the end of the served prompt but
    as two before a reply: the sample's prompt must end as the server's does (ĊĊ)."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}]
    chat_template, eot = (LLAMA3, "<|eot_id|>") if template == "llama3" else (QWEN3_PLAIN, "<|im_end|>")
    kwargs = {"chat_template": chat_template, "enable_thinking": False}
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True, **kwargs)
    whole = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    assert prompt.endswith("\n\n") and whole.startswith(prompt)
    served = _ids(tok, prompt)
    assert tok.convert_ids_to_tokens(served[-1]) == "ĊĊ"
    generated = _ids(tok, whole[len(prompt): whole.index(eot, len(prompt)) + len(eot)])

    ids, mask = tokenize_messages(tok, messages, **kwargs)
    assert ids[: len(served)] == served
    assert mask[: len(served)] == [0] * len(served)
    assert [i for i, m in zip(ids, mask, strict=True) if m] == generated
    assert ids[len(served): len(served) + len(generated)] == generated


@pytest.mark.integration
@pytest.mark.parametrize("reply", ["Hello", "Hello there", "    return x"])
def test_a_cut_reply_keeps_the_first_token_that_holds_mistrals_space(tok, reply):
    """Mistral v0.3 renders a reply as " " + content: the target generated "ĠHello" after
    "[/INST]". A reply cut at the generation limit keeps that token (a one-word reply was left
    with nothing supervised); its "</s>" was never generated."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}]
    ids, mask = tokenize_messages(tok, messages, chat_template=MISTRAL, unfinished_turns=(1,))
    whole = tok.apply_chat_template(messages, tokenize=False, chat_template=MISTRAL)
    start = whole.index("[/INST]") + len("[/INST]")
    expected = _ids(tok, whole[start: whole.index("</s>", start)])
    assert tok.convert_ids_to_tokens(expected[0]).startswith("Ġ")
    assert [i for i, m in zip(ids, mask, strict=True) if m] == expected
    finished_ids, finished_mask = tokenize_messages(tok, messages, chat_template=MISTRAL)
    assert finished_ids == ids and [i for i, m in zip(ids, finished_mask, strict=True) if m] == expected + _ids(tok, "</s>")


@pytest.mark.integration
def test_truncation_in_a_multi_token_character_keeps_the_mask_of_the_kept_tokens(tok):
    """Cut at every length: the kept ids and mask are the prefix of the whole sample, and the
    tokens of a character split over two (an emoji's bytes) are supervised with the reply."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "😀😀 ok"}]
    ids, mask = tokenize_messages(tok, messages)
    pieces = [tok.convert_ids_to_tokens(i) for i in ids]
    assert sum(1 for p in pieces if p == "Ģ") >= 2  # the emoji spans two tokens here
    for limit in range(1, len(ids) + 1):
        samples, stats = tokenize_conversations([Conversation("c", messages)], tok, max_length=limit,
                                                min_loss_tokens=0)
        assert samples[0].input_ids == ids[:limit] and samples[0].loss_mask == mask[:limit]
        assert stats.num_truncated == (limit < len(ids))
    start = mask.index(1)
    assert tok.decode(ids[start:]).startswith("😀😀 ok<|im_end|>")
