"""Round 16 of the target engines and data formats: a tokenizer without a chat template is said
to be one, errors of a prompt the target refuses name the prompt's file, line and id during
regeneration, a broken generation_config.json is refused, OpenAI content given as text parts
is read, and an empty prompt list is named."""

from __future__ import annotations

import json

import pytest
from test_target_r15 import CHAT_TEMPLATE, SHAPE, llama_folder, load, word_tokenizer

from draftforge.data.formats import DataFormatError, RowLocation, parse_row
from draftforge.errors import InputError
from draftforge.splitserve.config import GenerationConfig

# ------------------------------------------------------------- a tokenizer without a template


def test_a_tokenizer_without_a_chat_template_is_said_to_have_none_not_the_conversation_blamed():
    """A base model's tokenizer has no chat template: the error blamed conversation 0 ("the chat
    template fails on conversation 0 ...; change the conversation"), which no change fixes."""
    from draftforge.data.tokenize import ChatTemplateError
    from draftforge.splitserve.target import render_prompt

    tokenizer = word_tokenizer(chat_template=None)
    conversation = [{"role": "user", "content": "w1 w2"}]
    with pytest.raises(ChatTemplateError) as err:
        render_prompt(tokenizer, conversation, 0, GenerationConfig())
    assert str(err.value) == (
        "the target's tokenizer has no chat template (its tokenizer_config.json or "
        "chat_template.jinja gives none); set target.generation.chat_template to the Jinja text "
        "of one (e.g. as a YAML block scalar, chat_template: |)"
    )
    assert err.value.conversation_index is None  # regeneration names no prompt for it
    # the recipe's template is the remedy the message names
    given = render_prompt(tokenizer, conversation, 0, GenerationConfig(chat_template=CHAT_TEMPLATE))
    assert given == "<|im_start|> user w1 w2 <|im_end|> <|im_start|> assistant "


# ------------------------------------------------ a prompt the target refuses, during regeneration


def test_a_prompt_too_long_for_the_context_is_named_by_file_line_and_id_when_regenerating(tmp_path):
    """The context check named "conversation 1", the prompt's place in the generate call's
    batch, which the user cannot find in a file of thousands of prompts."""
    from draftforge.data.loading import load_conversations
    from draftforge.data.regenerate import answer_batch

    short = SHAPE.model_copy(update={"max_position_embeddings": 32})
    target = load(llama_folder(tmp_path / "target", shape=short))
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"id": "short", "prompt": "w1"}) + "\n"
                    + json.dumps({"id": "long", "prompt": " ".join(["w2"] * 20)}) + "\n")
    prompts = load_conversations([str(data)]).conversations
    settings = GenerationConfig(temperature=0, max_new_tokens=8, batch_size=2)
    with pytest.raises(InputError) as err:
        answer_batch(prompts, target, settings)
    # 20 words and the template's 5 markers: 25 tokens, and 8 new ones take 33 positions
    assert str(err.value) == (
        f"{data}, line 2 (id 'long'): target 'target': the prompt has 25 tokens: with "
        "target.generation.max_new_tokens 8, it and its reply could take 33 positions, more than "
        "the target's max_position_embeddings 32; shorten or leave out that prompt, or lower "
        "max_new_tokens"
    )


def test_a_later_turn_with_a_token_past_the_embedding_is_named_by_id_and_turn(tmp_path):
    """A token the tokenizer has and the embedding lacks, in the second user turn of the second
    prompt: named by its line, id and turn, not as "conversation 1" of the second call."""
    from draftforge.data.loading import load_conversations
    from draftforge.data.regenerate import answer_batch

    tokenizer = word_tokenizer()
    tokenizer.add_tokens(["w_new"])  # id 40: no embedding row in a model of 40
    target = load(llama_folder(tmp_path / "target", tokenizer))
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt": ["w1", "w2"]}) + "\n"
                    + json.dumps({"id": "b", "prompt": ["w3", "w4 w_new"]}) + "\n")
    prompts = load_conversations([str(data)]).conversations
    with pytest.raises(InputError) as err:
        answer_batch(prompts, target, GenerationConfig(temperature=0, max_new_tokens=3, batch_size=2))
    message = str(err.value)
    assert message.startswith(f"{data}, line 2 (id 'b'), user turn 2: target 'target': the prompt: "
                              "token id 40 ('w_new' to the tokenizer) at position "), message
    assert message.endswith("is outside the model's 40 embedding rows (ids 0..39); the tokenizer "
                            "and the weights do not match (tokens added to the tokenizer need the "
                            "model's embeddings resized, e.g. "
                            "`model.resize_token_embeddings(len(tokenizer))`)"), message


# -------------------------------------------------------------- a broken generation_config.json


def test_a_generation_config_that_does_not_parse_is_refused_naming_the_file(tmp_path):
    """transformers ignores a generation_config.json it cannot parse, and with it the end-of-turn
    ids it lists (Llama-3's <|eot_id|>): every reply ran to max_new_tokens, marked unfinished."""
    folder = llama_folder(tmp_path / "target")
    path = folder / "generation_config.json"
    path.write_text('{"eos_token_id": [3, 7],\n "bos_token_id": 2,}')
    with pytest.raises(InputError) as err:
        load(folder)
    assert str(err.value) == (
        f"{path} is not valid JSON (Expecting property name enclosed in double quotes: line 2 "
        "column 20); transformers would ignore it and with it the end-of-turn ids (eos_token_id) "
        "it lists: fix or fetch the file again"
    )
    path.write_text('{"eos_token_id": [3, 7],\n "bos_token_id": 2}')  # fixed: both ids end a turn
    assert load(folder).eos_token_ids() == [3, 7]


# ----------------------------------------------------------------- OpenAI content as parts


WHERE = RowLocation("chats.jsonl", 5)


def parse(row, expect="conversation"):
    return parse_row(row, WHERE, default_id="x", expect=expect)


def test_openai_text_parts_are_joined_with_spaces_as_sglang_joins_them():
    """SGLang's chat API accepts a content given as text parts and, for a template that renders
    a string content, joins their texts with a space; the row was refused ("got list")."""
    parts = [{"type": "text", "text": "Translate:"}, {"type": "text", "text": "bonjour"}]
    row = {"messages": [{"role": "user", "content": parts},
                        {"role": "assistant", "content": [{"type": "text", "text": "hello"}]}]}
    assert parse(row).messages == [{"role": "user", "content": "Translate: bonjour"},
                                   {"role": "assistant", "content": "hello"}]
    # SpecForge's role/content turns under 'conversations' are OpenAI's too
    turns = {"conversations": row["messages"]}
    assert parse(turns).messages == parse(row).messages


def test_openai_parts_that_are_not_text_are_refused_naming_the_part():
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]},
                        {"role": "assistant", "content": "A cat."}]}
    with pytest.raises(DataFormatError) as err:
        parse(row)
    assert str(err.value) == (
        "chats.jsonl, line 5: message 1 (user) content part 2 is of type 'image_url'; only text "
        'parts ({"type": "text", "text": ...}) are accepted: draftforge trains on text only'
    )
    row["messages"][0]["content"] = [{"type": "text", "text": None}]
    with pytest.raises(DataFormatError) as err:
        parse(row)
    assert str(err.value) == (
        "chats.jsonl, line 5: message 1 (user) content part 1 (text) 'text' must be a string, got null"
    )


def test_a_null_content_is_called_null_not_nonetype():
    """An assistant message that only calls tools has "content": null."""
    row = {"messages": [{"role": "user", "content": "Weather?"},
                        {"role": "assistant", "content": None, "tool_calls": []}]}
    with pytest.raises(DataFormatError) as err:
        parse(row, expect="prompt")
    assert str(err.value) == (
        "chats.jsonl, line 5: message 2 (assistant) content must be a string, got null (an "
        "assistant message with only tool_calls? draftforge trains on text replies)"
    )
    with pytest.raises(DataFormatError) as err:
        parse({"conversations": [{"from": "human", "value": None}]}, expect="prompt")
    assert str(err.value) == "chats.jsonl, line 5: turn 1 (human) value must be a string, got null"


# ------------------------------------------------------------------------ an empty prompt list


def test_an_empty_prompt_list_is_named_as_such():
    with pytest.raises(DataFormatError) as err:
        parse({"prompt": []}, expect="prompt")
    assert str(err.value) == (
        "chats.jsonl, line 5: 'prompt' is an empty list: give at least one user turn"
    )
