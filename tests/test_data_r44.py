"""Review round 44: tokenising long conversations, and special text past the max_length cut.

1. A conversation of many turns whose every reply starts with a newline and spaces (code:
   ``"\\n   return x"``) is tokenised in pieces, split where each generation prompt ends; the
   pieces were split off by recursion, one level a turn, so about a thousand such turns
   raised RecursionError. The pieces are now split off in a loop.
2. A reply the chat template rewrites beyond finding (checked for special-token text alone)
   was checked whole even where the cut to ``data.max_length`` dropped its special text: the
   conversation was dropped for text that is never trained on. Only the kept part counts now.
"""

from __future__ import annotations

import inspect
import sys

import pytest

from draftforge.data.formats import Conversation
from draftforge.data.tokenize import tokenize_conversations, tokenize_messages


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from draftforge.splitserve import smollm2

    return AutoTokenizer.from_pretrained(smollm2.ensure_smollm2())


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_conversation_of_many_turns_split_at_each_prompt_end_does_not_recurse(smollm2_tokenizer):
    """Each reply "\\n   return x" merges with its prompt's final newline as one string (ĊĠĠ),
    so the text is tokenised apart at every prompt end: 200 turns under a recursion limit of
    150 frames beyond the test's own (the recursive split needed one frame a turn)."""
    tok = smollm2_tokenizer
    turns = 200
    reply = "\n   return x"
    messages = []
    for n in range(turns):
        messages += [{"role": "user", "content": f"q{n}"}, {"role": "assistant", "content": reply}]
    whole = tok.apply_chat_template(messages, tokenize=False)
    marker = "<|im_start|>assistant\n"
    cuts, at = [], 0
    while (at := whole.find(marker, at)) >= 0:
        at += len(marker)
        cuts.append(at)
    assert len(cuts) == turns
    # the served prompt and the generated reply tokenised apart, turn by turn
    expected = [i for lo, hi in zip([0, *cuts], [*cuts, len(whole)], strict=True) for i in _ids(tok, whole[lo:hi])]
    assert expected != _ids(tok, whole)  # one string tokenises differently: the split matters

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 150)
    try:
        ids, mask = tokenize_messages(tok, messages)
    finally:
        sys.setrecursionlimit(limit)
    assert ids == expected
    generated = _ids(tok, reply + "<|im_end|>")  # what the target generates each turn
    assert [i for i, m in zip(ids, mask, strict=True) if m] == generated * turns


# SmolLM2's template, with the assistant's words rewritten (word -> Word): the reply cannot be
# found in the rendering, so its special-token text is looked for in the reply alone
REWRITING = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + (message['content'] "
    "| replace('word', 'Word')) + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _conv(reply: str) -> Conversation:
    return Conversation("c", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}])


def test_special_text_past_max_length_in_a_rewritten_reply_is_not_supervised(smollm2_tokenizer):
    tok = smollm2_tokenizer
    reply = "word " * 60 + "<|endoftext|>"
    rendered = tok.apply_chat_template(_conv(reply).messages, tokenize=False, chat_template=REWRITING)
    assert reply not in rendered and reply.strip() not in rendered  # rewritten: checked alone
    prompt = tok.apply_chat_template(_conv(reply).messages[:1], tokenize=False, add_generation_prompt=True,
                                     chat_template=REWRITING)
    kept = len(_ids(tok, prompt)) + 20  # the prompt and the first 20 of the reply's 62 tokens
    samples, stats = tokenize_conversations([_conv(reply)], tok, max_length=kept, min_loss_tokens=1,
                                            chat_template=REWRITING)
    assert (stats.num_truncated, stats.num_dropped_special, stats.dropped_ids) == (1, 0, [])
    assert [s.id for s in samples] == ["c"]
    word = _ids(tok, "Word")  # the rewritten text is what is supervised
    assert samples[0].input_ids == _ids(tok, prompt) + (word + _ids(tok, " Word") * 19)[:20]
    assert samples[0].loss_mask == [0] * len(_ids(tok, prompt)) + [1] * 20
    # the same text kept whole, or special text at the kept start of the reply: dropped as before
    for text, max_length in ((reply, 512), ("<|endoftext|> " + "word " * 60, kept)):
        samples, stats = tokenize_conversations([_conv(text)], tok, max_length=max_length,
                                                min_loss_tokens=1, chat_template=REWRITING)
        assert samples == [] and stats.num_dropped_special == 1 and stats.dropped_ids == ["c"]
    # a reply wholly past the cut: nothing of it supervised, nothing to drop for
    samples, stats = tokenize_conversations([_conv("<|endoftext|> " + "word " * 60)], tok, max_length=5,
                                            min_loss_tokens=0, chat_template=REWRITING)
    assert [s.loss_mask for s in samples] == [[0] * 5] and stats.num_dropped_special == 0
