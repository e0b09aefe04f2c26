"""A tokenisation error numbers a turn by its place in the row's own list, as the row's other
errors do, also when a top-level ``system`` key added a message before it (a review of data/,
2026-12-06: it said "assistant turn 3" of a row with two turns)."""

from __future__ import annotations

import pytest
from test_tokenize_r11 import QWEN3_PLAIN

from draftforge.data.formats import RowLocation, parse_row
from draftforge.data.tokenize import ChatTemplateError, tokenize_conversations

REPLY = "<think>\nhm\n</think>\n\nHello"  # reasoning in a reply, with thinking off: refused


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from draftforge.splitserve import smollm2

    return AutoTokenizer.from_pretrained(smollm2.ensure_smollm2())


@pytest.mark.integration
@pytest.mark.parametrize("system", [None, "", "Be brief."])
def test_the_turn_is_counted_in_the_rows_own_list(tok, system):
    row = {"id": "c7", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": REPLY}]}
    if system is not None:
        row["system"] = system
    conversation = parse_row(row, RowLocation("train.jsonl", 7), default_id="c7", expect="conversation")
    assert len(conversation.messages) == (3 if system else 2)
    with pytest.raises(ChatTemplateError) as err:
        tokenize_conversations([conversation], tok, max_length=64, min_loss_tokens=1,
                               chat_template=QWEN3_PLAIN)
    assert "): turn 2 (assistant) is not what the target writes with thinking off" in str(err.value)
