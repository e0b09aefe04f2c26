"""Chat template -> token ids and loss mask, checked token by token.

The fast tests use a small ChatML tokenizer built here (one token per word,
space, newline and punctuation mark), so the expected tokens and mask can be
written out by hand. The integration test checks SmolLM2's real tokenizer and
chat template against expected tokens also written out by hand.
"""

from __future__ import annotations

import pytest
from tokenizers import Regex, Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Split
from transformers import PreTrainedTokenizerFast

from draftforge.data.formats import Conversation
from draftforge.data.tokenize import ChatTemplateError, tokenize_conversations, tokenize_messages

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = [
    "<unk>",
    "<|im_start|>",
    "<|im_end|>",
    "system",
    "user",
    "assistant",
    "\n",
    " ",
    "Be",
    "brief",
    ".",
    "Hi",
    "Hello",
    "there",
    "!",
    "Bye",
    "Ok",
    "a",
    "b",
    "c",
    "d",
]


def chatml_tokenizer() -> PreTrainedTokenizerFast:
    model = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    model.pre_tokenizer = Split(Regex(r"\s|\w+|[^\w\s]"), behavior="isolated")
    model.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", eos_token="<|im_end|>")
    tok.chat_template = CHATML
    return tok


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there!"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Ok"},
]
# (token, supervised) written out by hand from the ChatML layout.
EXPECTED = [
    ("<|im_start|>", 0),
    ("system", 0),
    ("\n", 0),
    ("Be", 0),
    (" ", 0),
    ("brief", 0),
    (".", 0),
    ("<|im_end|>", 0),
    ("\n", 0),
    ("<|im_start|>", 0),
    ("user", 0),
    ("\n", 0),
    ("Hi", 0),
    ("<|im_end|>", 0),
    ("\n", 0),
    ("<|im_start|>", 0),
    ("assistant", 0),
    ("\n", 0),
    ("Hello", 1),
    (" ", 1),
    ("there", 1),
    ("!", 1),
    ("<|im_end|>", 1),
    ("\n", 0),
    ("<|im_start|>", 0),
    ("user", 0),
    ("\n", 0),
    ("Bye", 0),
    ("<|im_end|>", 0),
    ("\n", 0),
    ("<|im_start|>", 0),
    ("assistant", 0),
    ("\n", 0),
    ("Ok", 1),
    ("<|im_end|>", 1),
    ("\n", 0),
]


def test_mask_token_by_token_hand_built_chatml():
    tok = chatml_tokenizer()
    ids, mask = tokenize_messages(tok, CONVERSATION)
    assert [(tok.convert_ids_to_tokens(i), m) for i, m in zip(ids, mask, strict=True)] == EXPECTED


def test_template_override_is_used():
    tok = chatml_tokenizer()
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenize_messages(tok, CONVERSATION)
    ids, mask = tokenize_messages(tok, CONVERSATION, chat_template=CHATML)
    assert [m for _, m in EXPECTED] == mask


def test_turns_a_template_rewrites_later_are_context_and_the_last_turn_is_supervised():
    tok = chatml_tokenizer()
    # Drops every assistant turn but the last: the earlier one is not in the later prompt.
    rewriting = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    ids, mask = tokenize_messages(tok, CONVERSATION, chat_template=rewriting)
    assert [tok.convert_ids_to_tokens(i) for i, m in zip(ids, mask, strict=True) if m] == ["Ok", "<|im_end|>"]
    assert "Hello" not in tok.convert_ids_to_tokens(ids)
    samples, stats = tokenize_conversations([Conversation("c", CONVERSATION)], tok, max_length=100,
                                            min_loss_tokens=1, chat_template=rewriting)  # fmt: skip
    assert samples[0].loss_mask == mask and stats.num_context_turns == 1
    assert stats.summary().endswith("1 earlier assistant turns left unsupervised (the chat template "
                                    "rewrites them in later prompts)")  # fmt: skip
    # the last turn itself must render as an extension of its prompt
    other_header = CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>bot\n'")
    with pytest.raises(ChatTemplateError, match=r"message 5 \(assistant\) as an extension"):
        tokenize_messages(tok, CONVERSATION, chat_template=other_header)


# Qwen3's layout without thinking: an empty reasoning block in the generation prompt and in
# the last assistant turn only, so earlier turns lose it once the conversation goes on.
QWEN3_LIKE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% if loop.last %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{{ m['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}{% endif %}"
)


def test_a_qwen3_like_multi_turn_conversation_supervises_its_last_turn():
    from draftforge.data.tokenize import assistant_spans

    text, spans, context = assistant_spans(chatml_tokenizer(), CONVERSATION, chat_template=QWEN3_LIKE)
    assert [text[a:b] for a, b in spans] == ["Ok<|im_end|>"] and context == [2]
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nOk<|im_end|>\n")
    # one turn: the generation prompt's reasoning block is the prompt, the reply is supervised
    _, spans, context = assistant_spans(chatml_tokenizer(), CONVERSATION[:3], chat_template=QWEN3_LIKE)
    assert context == [] and len(spans) == 1


def test_a_cut_reply_is_found_where_the_template_strips_it_or_puts_text_before_it():
    from draftforge.data.tokenize import assistant_spans

    tok = chatml_tokenizer()
    stripping = CHATML.replace("m['content']", "(m['content'] | trim)")
    for reply in ("Hello there!\n\n", " Hello there!"):
        messages = [*CONVERSATION[:2], {"role": "assistant", "content": reply}]
        text, spans, _ = assistant_spans(tok, messages, chat_template=stripping, unfinished_turns=(2,))
        assert [text[a:b] for a, b in spans] == ["Hello there!"]
    # a template that adds an empty reasoning block before a reply without one: not generated,
    # and not in the served prompt either, so left out of the sample (round 45)
    inserting = QWEN3_LIKE.replace("{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}",
                                   "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}")
    messages = [*CONVERSATION[:2], {"role": "assistant", "content": "<think>\nLet me"}]
    text, spans, _ = assistant_spans(tok, messages, chat_template=inserting, unfinished_turns=(2,))
    assert "<|im_start|>assistant\n<think>\nLet me<|im_end|>" in text
    assert [text[a:b] for a, b in spans] == ["<think>\nLet me"]


def conv(cid: str, reply: str) -> Conversation:
    return Conversation(
        cid, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}]
    )


def test_truncation_and_min_loss_tokens_drop_are_counted():
    tok = chatml_tokenizer()
    # Prompt part: <|im_start|> user \n Hi <|im_end|> \n <|im_start|> assistant \n = 9 tokens.
    convs = [conv("long", "a b c d"), conv("short", "a"), conv("cut", "a b c d a b c d")]
    samples, stats = tokenize_conversations(convs, tok, max_length=20, min_loss_tokens=3)
    # long: 9 + 7 reply tokens + <|im_end|> + \n = 18 tokens, 8 supervised.
    # short: 1 + <|im_end|> = 2 supervised < 3 -> dropped.
    # cut: 9 + 15 + 2 = 26 tokens -> 20 kept, 11 supervised (no end marker left).
    assert [s.id for s in samples] == ["long", "cut"]
    assert [len(s.input_ids) for s in samples] == [18, 20]
    assert [s.num_loss_tokens for s in samples] == [8, 11]
    assert samples[1].loss_mask == [0] * 9 + [1] * 11
    assert (stats.num_conversations, stats.num_kept, stats.num_truncated) == (3, 2, 1)
    assert stats.num_dropped_short == 1 and stats.dropped_ids == ["short"]
    assert stats.summary() == "2/3 samples kept, 1 truncated, 1 dropped (too few supervised tokens)"


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from draftforge.splitserve import smollm2

    return AutoTokenizer.from_pretrained(smollm2.ensure_smollm2())


@pytest.mark.integration
def test_mask_token_by_token_smollm2(smollm2_tokenizer):
    tok = smollm2_tokenizer
    messages = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    ids, mask = tokenize_messages(tok, messages)
    # SmolLM2's template adds its default system prompt when there is none.
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    full = tok.apply_chat_template(messages, tokenize=False)
    assert full.startswith(f"<|im_start|>system\n{system}<|im_end|>\n")
    assert ids == tok(full, add_special_tokens=False)["input_ids"]
    num_system = len(
        tok(f"<|im_start|>system\n{system}<|im_end|>\n", add_special_tokens=False)["input_ids"]
    )
    got = [(tok.convert_ids_to_tokens(i), m) for i, m in zip(ids, mask, strict=True)][num_system:]
    expected = [
        ("<|im_start|>", 0),
        ("user", 0),
        ("Ċ", 0),
        ("Hi", 0),
        ("Ġthere", 0),
        ("<|im_end|>", 0),
        ("Ċ", 0),
        ("<|im_start|>", 0),
        ("ass", 0),
        ("istant", 0),
        ("Ċ", 0),
        ("Hello", 1),
        ("!", 1),
        ("ĠHow", 1),
        ("Ġcan", 1),
        ("ĠI", 1),
        ("Ġhelp", 1),
        ("?", 1),
        ("<|im_end|>", 1),
        ("Ċ", 0),
        ("<|im_start|>", 0),
        ("user", 0),
        ("Ċ", 0),
        ("2", 0),
        ("+", 0),
        ("2", 0),
        ("?", 0),
        ("<|im_end|>", 0),
        ("Ċ", 0),
        ("<|im_start|>", 0),
        ("ass", 0),
        ("istant", 0),
        ("Ċ", 0),
        ("4", 1),
        ("<|im_end|>", 1),
        ("Ċ", 0),
    ]
    assert got == expected
    assert sum(mask[:num_system]) == 0
    # The end-of-turn marker that generation stops at is the eos token, and it is supervised.
    assert tok.eos_token == "<|im_end|>"


def test_unfinished_reply_leaves_its_end_marker_unsupervised():
    """A reply cut at max_new_tokens: its text is supervised, the template's <|im_end|> is not."""
    tok = chatml_tokenizer()
    ids, mask = tokenize_messages(tok, CONVERSATION, unfinished_turns=(2,))
    got = [(tok.convert_ids_to_tokens(i), m) for i, m in zip(ids, mask, strict=True)]
    expected = list(EXPECTED)
    first_reply_end = 22  # the <|im_end|> after "Hello there!"
    assert expected[first_reply_end] == ("<|im_end|>", 1)
    expected[first_reply_end] = ("<|im_end|>", 0)
    assert got == expected


def test_unfinished_turns_reach_tokenize_conversations_from_rows():
    from draftforge.data.formats import RowLocation, parse_row
    from draftforge.data.tokenize import tokenize_conversations

    row = {"id": "a", "messages": CONVERSATION, "unfinished_turns": [4]}
    conv = parse_row(row, RowLocation("x.jsonl", 1), default_id="x:1", expect="conversation")
    samples, _ = tokenize_conversations([conv], chatml_tokenizer(), max_length=100, min_loss_tokens=1)
    # The last reply "Ok" keeps its loss; its <|im_end|> (second to last token) loses it.
    assert samples[0].loss_mask[-3:] == [1, 0, 0]


def test_a_template_that_refuses_a_row_names_it(tmp_path):
    """A template may refuse a conversation (Gemma's: no system role); the error names the row."""
    import json
    import re

    from draftforge.data.loading import load_conversations

    no_system = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                 "{{ raise_exception('System role not supported') }}{% endif %}"
                 "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")  # fmt: skip
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"id": "fine", "messages": CONVERSATION[1:3]}) + "\n"
                    + json.dumps({"id": "with-system", "messages": CONVERSATION}) + "\n")
    conversations = load_conversations([str(path)], expect="conversation").conversations
    samples, _ = tokenize_conversations(conversations[:1], chatml_tokenizer(), max_length=100,
                                        min_loss_tokens=1, chat_template=no_system)
    assert len(samples) == 1
    with pytest.raises(ChatTemplateError, match=rf"{re.escape(str(path))}, line 2 \(id 'with-system'\): the chat template "
                                                r"fails on this conversation \(System role not supported\)"):
        tokenize_conversations(conversations, chatml_tokenizer(), max_length=100, min_loss_tokens=1,
                               chat_template=no_system)
