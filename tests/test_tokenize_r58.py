"""Session 58: an end-of-turn marker the tokenizer does not know as a special token.

``_trailer`` finds what a template appends after the last message when no generation prompt
follows (Phi-3's ``eos_token``) where the tokens of the rendering without and with the
generation prompt part ways. Under a plain-text ``<|eot_id|>`` (a Llama-3-style template over
a tokenizer without that token), byte-level BPE merges the marker's ``>`` with the generation
prompt's ``<|``: the tokens part at the ``>``, which was taken for a trailer and cut from every
assistant turn's supervised tokens, so the draft never learnt to end a turn.
"""

from __future__ import annotations

import pytest
from test_tokenize_r33 import PHI3

from draftforge.data.tokenize import tokenize_messages

PLAIN_LLAMA3 = ("{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
                " + m['content'] + '<|eot_id|>' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


@pytest.fixture(scope="module")
def plain_tok():
    from transformers import AutoTokenizer

    from draftforge.splitserve import smollm2

    return AutoTokenizer.from_pretrained(smollm2.ensure_smollm2())  # no Llama-3 or Phi-3 special tokens


def _supervised(tok, messages, template) -> str:
    ids, mask = tokenize_messages(tok, messages, chat_template=template)
    return tok.decode([i for i, m in zip(ids, mask, strict=True) if m])


@pytest.mark.integration
def test_a_plain_text_end_of_turn_marker_is_supervised_whole(plain_tok):
    user = {"role": "user", "content": "Hi"}
    one = [user, {"role": "assistant", "content": "Hello"}]
    assert _supervised(plain_tok, one, PLAIN_LLAMA3) == "Hello<|eot_id|>"
    two = [*one, {"role": "user", "content": "More"}, {"role": "assistant", "content": "Sure"}]
    # inside the conversation the first turn's ">" merges with the next header's "<" into one
    # token ("><"), which holds the marker's end and is supervised as the turn's last token
    assert _supervised(plain_tok, two, PLAIN_LLAMA3) == "Hello<|eot_id|><Sure<|eot_id|>"


@pytest.mark.integration
def test_a_real_trailer_is_still_left_out(plain_tok):
    """Phi-3's template ends a conversation with ``</s>``, which no turn generates; as plain text
    too it is not in the rendering with the generation prompt, so it stays a trailer."""
    two = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
           {"role": "user", "content": "More"}, {"role": "assistant", "content": "Sure"}]
    assert _supervised(plain_tok, two, PHI3) == "Hello<|end|>Sure<|end|>"
