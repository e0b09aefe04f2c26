"""Review round 49: a reply cut at max_new_tokens whose text the chat template rewrites.

Its supervised tokens cannot be located (where the cut reply ends is found by its text), so
it raised ChatTemplateError, which the producer does not catch: one such answer stopped a
training hours in. It is dropped and counted now, as special-token text in a reply is.
"""

from __future__ import annotations

import pytest
from test_data_r44 import REWRITING

from draftforge.data.formats import Conversation
from draftforge.data.tokenize import RewrittenReply, tokenize_conversations, tokenize_messages


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from draftforge.splitserve import smollm2

    return AutoTokenizer.from_pretrained(smollm2.ensure_smollm2())


def _conv(conv_id: str, reply: str, *, cut: bool) -> Conversation:
    return Conversation(conv_id, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}],
                        extra={"unfinished_turns": [1]} if cut else {})


def test_a_cut_reply_the_template_rewrites_is_dropped_and_counted(smollm2_tokenizer):
    tok = smollm2_tokenizer
    rows = [_conv("a", "some word here", cut=True),   # rewritten ('word' -> 'Word'), cut: not locatable
            _conv("b", "no such text", cut=True),     # cut, not rewritten: kept
            _conv("c", "some word here", cut=False)]  # rewritten, finished: kept (the template's text)
    samples, stats = tokenize_conversations(rows, tok, max_length=512, min_loss_tokens=1, chat_template=REWRITING)
    assert [s.id for s in samples] == ["b", "c"]
    assert (stats.num_dropped_rewritten, stats.rewritten_example, stats.dropped_ids) == (1, "a", ["a"])
    assert stats.num_dropped_special == stats.num_dropped_short == 0
    assert "1 dropped (the chat template rewrites the text of a reply cut at max_new_tokens" in stats.summary()
    assert "e.g. conversation 'a'" in stats.summary()
    # one conversation alone still says why, as the error it is
    with pytest.raises(RewrittenReply, match=r"cannot find the text of message 2 \(assistant\), cut at max_new_tokens, "):
        tokenize_messages(tok, rows[0].messages, chat_template=REWRITING, unfinished_turns=[1])


def test_the_target_ranks_data_note_says_so(tmp_path):
    import types

    from splitserve_helpers import tiny_recipe

    from draftforge.config import load_recipe
    from draftforge.splitserve.producer import data_note

    cfg = load_recipe(tiny_recipe(tmp_path))
    source = types.SimpleNamespace(dropped_short=2, dropped_special=0, special_example=None, truncated=1,
                                   dropped_rewritten=3, rewritten_example="a#e1")
    note = data_note(cfg, 0, source)
    assert note.startswith("target rank 0: 2 conversations dropped (fewer than data.min_loss_tokens=")
    assert ("3 dropped (the chat template rewrites the text of a reply cut at max_new_tokens, so its "
            "supervised tokens cannot be located, e.g. conversation 'a#e1'), 1 cut to data.max_length") in note
