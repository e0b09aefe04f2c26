"""Review round 57 of data/: a system prompt of whitespace only, and how errors number turns.

1. A top-level ``system`` key of whitespace only (``" "``, ``"\\n"``) became a system message,
   which SmolLM2's chat template renders in place of its default system prompt, where an
   empty one ("") is no system prompt; a leading system message of whitespace only did the
   same. Both are refused now, naming the file, the line and the key or message.
2. Tokenisation errors said "assistant turn 2" of the 2nd entry of a row, where the held-out
   check's "assistant turn 2" is the 2nd assistant reply and the row's own errors say
   "message 2 (assistant)": they name it as the row's own errors do now.
"""

from __future__ import annotations

import json

import pytest
from test_data_r44 import REWRITING
from test_tokenize_r11 import QWEN3_PLAIN

from draftforge.data.formats import DataFormatError, RowLocation, parse_row
from draftforge.data.loading import load_conversations
from draftforge.data.tokenize import (
    ChatTemplateError,
    RewrittenReply,
    render,
    tokenize_conversations,
    tokenize_messages,
)

SMOLLM2_DEFAULT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
HI = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
HI_SHAREGPT = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]
BLANKS = [" ", "\n", " \t\n "]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from draftforge.splitserve import smollm2

    return AutoTokenizer.from_pretrained(smollm2.ensure_smollm2())


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _served(system: str) -> str:
    """SmolLM2's prompt for "Hi" with system prompt ``system``, written out by hand."""
    return (f"<|im_start|>system\n{system}<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


# --------------------------------------------------------------------------- 1. blank system


@pytest.mark.integration
@pytest.mark.parametrize("blank", BLANKS)
def test_a_blank_system_key_would_replace_smollm2s_default_system_prompt(tok, blank):
    """What such a row became (a system message of the blank text) renders the blank text where
    a row without a system prompt has SmolLM2's default one."""
    assert render(tok, [{"role": "user", "content": "Hi"}], add_generation_prompt=True) == _served(SMOLLM2_DEFAULT)
    as_was = [{"role": "system", "content": blank}, {"role": "user", "content": "Hi"}]
    assert render(tok, as_was, add_generation_prompt=True) == _served(blank)
    assert SMOLLM2_DEFAULT not in _served(blank)


@pytest.mark.parametrize("blank", BLANKS)
@pytest.mark.parametrize(("form", "expect"), [("messages", "prompt"), ("messages", "conversation"),
                                              ("conversations", "prompt"), ("conversations", "conversation"),
                                              ("prompt", "prompt")])
def test_a_blank_system_key_is_refused_at_its_row(tmp_path, blank, form, expect):
    body = {"messages": HI, "conversations": HI_SHAREGPT, "prompt": "Hi"}[form]
    path = _write(tmp_path / "chats.jsonl", [{form: body}, {"system": blank, form: body}])
    with pytest.raises(DataFormatError) as err:
        load_conversations([str(path)], expect=expect)
    assert str(err.value) == (
        f"{path}, line 2: 'system' holds only whitespace ({blank!r}), which the chat template would "
        "render in place of its default system prompt; for no system prompt (the template's default "
        "applies, as when serving a request without one) leave it out or give the key as \"\"; else "
        "write the system prompt")
    # data.skip_invalid skips it, with the reason, and keeps the other row
    result = load_conversations([str(path)], expect=expect, skip_invalid=True)
    assert [c.id for c in result.conversations] == ["chats-1"]
    assert [s.where for s in result.skipped] == [f"{path}, line 2"]
    assert result.skipped[0].reason.startswith("'system' holds only whitespace")


@pytest.mark.parametrize("blank", BLANKS)
def test_a_blank_leading_system_message_is_refused_naming_it(tmp_path, blank):
    rows = [{"messages": [{"role": "system", "content": blank}, *HI]},
            {"conversations": [{"from": "system", "value": blank}, *HI_SHAREGPT]}]
    for line, (row, name) in enumerate(zip(rows, ["message 1", "turn 1"], strict=True), start=1):
        for expect in ("prompt", "conversation"):
            with pytest.raises(DataFormatError) as err:
                parse_row(row, RowLocation("d.jsonl", line), default_id="d", expect=expect)
            assert str(err.value) == (
                f"d.jsonl, line {line}: {name} (system) holds only whitespace ({blank!r}), which the chat "
                "template would render in place of its default system prompt; for no system prompt (the "
                "template's default applies, as when serving a request without one) remove the message, "
                "else write the system prompt")


@pytest.mark.integration
def test_what_is_kept_renders_as_before(tok):
    """An empty or absent key is no system prompt (the default applies); a system prompt with
    text around its words, and an empty leading system message, are rendered as given."""
    where = RowLocation("d.jsonl", 1)
    for row in ({"prompt": "Hi"}, {"prompt": "Hi", "system": ""}, {"prompt": "Hi", "system": None}):
        conv = parse_row(row, where, default_id="d", expect="prompt")
        assert render(tok, conv.messages, add_generation_prompt=True) == _served(SMOLLM2_DEFAULT)
    conv = parse_row({"prompt": "Hi", "system": " Be brief.\n"}, where, default_id="d", expect="prompt")
    assert render(tok, conv.messages, add_generation_prompt=True) == _served(" Be brief.\n")
    empty = {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}]}
    conv = parse_row(empty, where, default_id="d", expect="prompt")
    assert render(tok, conv.messages, add_generation_prompt=True) == _served("")


# --------------------------------------------------------------------------- 2. turn numbers


def _row(form: str, replies: list[str], system: str | None = None) -> dict:
    turns = []
    for n, reply in enumerate(replies, start=1):
        turns += [{"role": "user", "content": f"Q{n}"}, {"role": "assistant", "content": reply}]
    if form == "conversations":
        turns = [{"from": {"user": "human", "assistant": "gpt"}[t["role"]], "value": t["content"]}
                 for t in turns]
    row = {"id": "c7", form: turns}
    if system is not None:
        row["system"] = system
    return row


@pytest.mark.integration
@pytest.mark.parametrize("system", [None, "Be brief."])
@pytest.mark.parametrize(("form", "entry"), [("messages", "message"), ("conversations", "turn")])
def test_a_tokenisation_error_names_the_entry_as_the_rows_own_errors_do(tok, system, form, entry):
    """The reply with a reasoning block under thinking off is the row's 4th entry (its 2nd
    assistant reply; a top-level system key is no entry of the row's list)."""
    reasoning = "<think>\nhm\n</think>\n\nHello"
    row = _row(form, ["Fine.", reasoning], system)
    conv = parse_row(row, RowLocation("train.jsonl", 7), default_id="c7", expect="conversation")
    with pytest.raises(ChatTemplateError) as err:
        tokenize_conversations([conv], tok, max_length=128, min_loss_tokens=1, chat_template=QWEN3_PLAIN)
    assert str(err.value).startswith(
        f"train.jsonl, line 7 (id 'c7'): {entry} 4 (assistant) is not what the target writes with "
        "thinking off"), str(err.value)
    # the row's own check names that entry the same way (its 'weight' of 0 is refused)
    turns = row[form]
    turns[3] = {**turns[3], "weight": 0}
    with pytest.raises(DataFormatError, match=rf"^train.jsonl, line 7: {entry} 4 \(assistant\) has 'weight' 0"):
        parse_row(row, RowLocation("train.jsonl", 7), default_id="c7", expect="conversation")


@pytest.mark.integration
def test_the_other_tokenisation_errors_name_the_entry_too(tok):
    messages = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "some word here"}]
    # a chat template given as a file path renders the same text for every conversation
    with pytest.raises(ChatTemplateError, match=r"^the chat template renders message 2 \(assistant\) as nothing"):
        tokenize_messages(tok, messages, chat_template="templates/chatml.jinja")
    # a template that rewrites the prompt once a reply is added (here: the user turns)
    rewrites_prompt = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
                       "(' (last)' if loop.last and m['role'] == 'user' else '') + '<|im_end|>\n' }}{% endfor %}"
                       "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    with pytest.raises(ChatTemplateError,
                       match=r"^the chat template does not render message 4 \(assistant\) as an extension"):
        tokenize_messages(tok, messages, chat_template=rewrites_prompt)
    # a cut reply whose text the template rewrites: the 4th message, index 3 of unfinished_turns
    with pytest.raises(RewrittenReply,
                       match=r"^cannot find the text of message 4 \(assistant\), cut at max_new_tokens, in its"):
        tokenize_messages(tok, messages, chat_template=REWRITING, unfinished_turns=[3])
