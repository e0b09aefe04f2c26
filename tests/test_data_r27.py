"""Review round 27, the data the project trains on (data/tokenize, data/formats, data/loading).

Loss masks are compared with transformers' own ``apply_chat_template(
return_assistant_tokens_mask=True)`` on a twin of the template whose ``{% generation %}``
blocks mark by hand what the target generates (the reply and its end-of-turn marker).
"""

from __future__ import annotations

import gzip
import json

import pytest
from tokenizers import Regex, Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Split
from transformers import PreTrainedTokenizerFast

from draftforge.data.formats import Conversation, DataFormatError
from draftforge.data.loading import load_conversations
from draftforge.data.tokenize import tokenize_conversations, tokenize_messages

PHI3_SPECIAL = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"]
PHI3_WORDS = ["<unk>", *PHI3_SPECIAL, "\n", " ", "Be", "brief", ".", "Hi", "Hello", "there", "!", "Bye", "Ok"]
# Phi-3-mini's template: eos_token after the last message where no generation prompt follows.
PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
# marked: the reply and <|end|> (generation stops there), not the newline nor the eos after
PHI3_MARKED = PHI3.replace(
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}",
    "{{'<|assistant|>\n'}}{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}"
    "{{ '\n' }}",
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there!"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Ok"},
]


def phi3_tokenizer() -> PreTrainedTokenizerFast:
    model = Tokenizer(WordLevel({w: i for i, w in enumerate(PHI3_WORDS)}, unk_token="<unk>"))
    model.pre_tokenizer = Split(Regex(r"\s|\w+|[^\w\s]"), behavior="isolated")
    model.add_special_tokens(PHI3_SPECIAL)
    tok = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", eos_token="<|endoftext|>")
    tok.chat_template = PHI3
    return tok


@pytest.mark.parametrize("turns", [3, 5])
def test_a_template_appending_eos_after_the_conversation_supervises_every_turn_and_not_the_eos(turns):
    """Phi-3's template ends a rendering without generation prompt with eos_token: every reply
    (earlier ones were left unsupervised as if rewritten) and its <|end|> are supervised, the
    newline and eos after the last one (never generated) are not."""
    tok, messages = phi3_tokenizer(), CONVERSATION[:turns]
    expected = tok.apply_chat_template(messages, chat_template=PHI3_MARKED, tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)
    assert sum(expected["assistant_masks"]) == {3: 5, 5: 7}[turns]  # Hello, ' ', there, !, <|end|> (, Ok, <|end|>)
    assert tokenize_messages(tok, messages) == (list(expected["input_ids"]), list(expected["assistant_masks"]))
    _, stats = tokenize_conversations([Conversation("c", messages)], tok, max_length=100, min_loss_tokens=1)
    assert stats.num_context_turns == 0


def test_a_reply_keeping_its_reasoning_apart_is_refused_with_its_line_not_trained_without_it(tmp_path):
    """An OpenAI-compatible server with a reasoning parser returns a thinking target's reply as
    reasoning_content + content; only the content was trained on, without a word."""
    reply = {"role": "assistant", "content": "4", "reasoning_content": "2 + 2 is 4."}
    rows = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        {"messages": [{"role": "user", "content": "2 + 2?"}, reply]},
        {"conversations": [{"role": "user", "content": "2 + 2?"}, {**reply, "reasoning_content": None}]},
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(DataFormatError) as err:
        load_conversations([str(path)], expect="conversation")
    assert str(err.value).startswith(f"{path}, line 2: message 2 (assistant) has its reasoning in "
                                     "'reasoning_content'")
    # read as prompts the replies are dropped (the target answers anew); a null is no reasoning
    assert len(load_conversations([str(path)], expect="prompt").conversations) == 3
    path.write_text("".join(json.dumps(row) + "\n" for row in rows[::2]))
    assert len(load_conversations([str(path)], expect="conversation").conversations) == 2


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_a_json_file_holding_one_object_a_line_reads_as_its_jsonl_twin(tmp_path, suffix):
    """datasets' json loader (SpecForge's, LLaMA-Factory's) reads a .json written one object a
    line; draftforge refused it at line 2 ("Extra data"). Its rows are named by their lines."""
    rows = [{"id": "a", "prompt": "Hi"}, {"prompt": ["Bye", "Ok"], "system": "Be brief."}]
    text = "".join(json.dumps(row) + "\n" for row in rows)
    twin = tmp_path / "rows.jsonl"
    twin.write_text(text)
    path = tmp_path / f"rows{suffix}"

    def write(data: bytes) -> None:
        path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)

    write(text.encode())
    got = load_conversations([str(path)]).conversations
    assert [(c.id, c.messages, c.source) for c in got] == [
        ("a", [{"role": "user", "content": "Hi"}], f"{path}, line 1"),
        ("rows-2", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bye"},
                    {"role": "user", "content": "Ok"}], f"{path}, line 2"),
    ]
    assert [c.messages for c in got] == [c.messages for c in load_conversations([str(twin)]).conversations]
    # a list of rows followed by something else is still refused where the extra text starts
    write(b'[{"prompt": "Hi"}]\n{"prompt": "Bye"}\n')
    with pytest.raises(DataFormatError, match=r", line 2: invalid JSON: Extra data"):
        load_conversations([str(path)])
