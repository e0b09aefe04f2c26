"""Leftovers in the data path: replies cut inside a character, the JSON kind of a non-object
row, a 0-byte ``.partial`` left by Ctrl-C."""

from __future__ import annotations

import json

import pytest
from regenerate_helpers import SETTINGS, FakeEngine, make_prompts

from draftforge.data.formats import DataFormatError, RowLocation, parse_row
from draftforge.data.regenerate import regenerate
from draftforge.data.tokenize import tokenize_messages


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from draftforge.splitserve import smollm2

    return AutoTokenizer.from_pretrained(smollm2.ensure_smollm2())


# -- 1. a reply cut at max_new_tokens inside a multi-byte character ---------------------------

def _hf_target_with(tokenizer, replies, eos):
    """An HFTarget whose generation returns ``replies`` (token ids): only its decoding runs."""
    from draftforge.splitserve.hf_backend import HFTarget

    target = HFTarget.__new__(HFTarget)
    target._tokenizer = tokenizer
    target.generate_token_ids = lambda conversations, settings: [list(r) for r in replies]
    target.eos_token_ids = lambda: list(eos)
    return target


@pytest.mark.integration
def test_a_reply_cut_inside_a_character_ends_with_its_last_whole_character(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok("Hi 🙂 日本", add_special_tokens=False)["input_ids"]
    # byte-level BPE: "Ġæ", "Ĺ", "¥" spell " 日" (E6 97 A5); a cut after "Ġæ" or "Ĺ" is inside it
    assert tok.convert_ids_to_tokens(ids[2:5]) == ["Ġæ", "Ĺ", "¥"]
    eos = [tok.convert_tokens_to_ids("<|im_end|>")]
    cut = [ids[:3], ids[:4], ids[:5], ids[:2] + eos]
    target = _hf_target_with(tok, cut, eos)
    replies = target.generate([[{"role": "user", "content": "emoji?"}]] * 4, SETTINGS)
    assert [str(r) for r in replies] == ["Hi 🙂", "Hi 🙂", "Hi 🙂 日", "Hi 🙂"]
    assert [r.finished for r in replies] == [False, False, False, True]
    # training re-tokenises the row: its supervised tokens are the ones the target generated
    for reply, generated in zip(replies[:3], [ids[:2], ids[:2], ids[:5]], strict=True):
        messages = [{"role": "user", "content": "emoji?"}, {"role": "assistant", "content": str(reply)}]
        row_ids, mask = tokenize_messages(tok, messages, unfinished_turns=[1])
        assert [t for t, m in zip(row_ids, mask, strict=True) if m] == generated


@pytest.mark.integration
def test_an_ascii_reply_decodes_as_before(smollm2_tokenizer):
    from draftforge.splitserve.target import generated_reply

    tok = smollm2_tokenizer
    text = "Urban heat islands refer to areas that are warmer.\n\n1. Trees"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for n in range(len(ids) + 1):
        for finished in (True, False):
            generated = ids[:n] + ([eos] if finished else [])
            reply = generated_reply(tok, generated, finished, [eos])
            assert reply == tok.batch_decode([generated], skip_special_tokens=True)[0]
            assert reply.token_ids == tuple(ids[:n])  # the end-of-turn token left out


# -- 3. a row that is not a JSON object names its JSON kind ------------------------------------

@pytest.mark.parametrize(("row", "kind"), [(None, "null"), ([1], "a list"), (3, "a number"),
                                           (2.5, "a number"), ("hi", "a string"), (True, "a boolean")])
def test_a_row_that_is_no_object_says_what_it_is(row, kind):
    with pytest.raises(DataFormatError) as err:
        parse_row(row, RowLocation("data.jsonl", 4), default_id="data-4")
    assert str(err.value) == f"data.jsonl, line 4: a row must be a JSON object, got {kind}"


# -- 4. Ctrl-C before the first batch leaves a 0-byte .partial -----------------------------------

class InterruptedWhileLoading(FakeEngine):
    """A worker pool stopped by Ctrl-C while its workers load the target: no batch answered."""

    def answer_batches(self, pending, settings):
        raise KeyboardInterrupt
        yield  # pragma: no cover


def test_a_rerun_continues_from_an_empty_partial(tmp_path):
    prompts = make_prompts(7)
    fresh = tmp_path / "fresh.jsonl"
    regenerate(prompts, FakeEngine(), SETTINGS, fresh, progress=False)

    out = tmp_path / "out.jsonl"
    with pytest.raises(KeyboardInterrupt):
        regenerate(prompts, InterruptedWhileLoading(), SETTINGS, out, progress=False)
    partial = out.with_name(out.name + ".partial")
    assert partial.exists() and partial.stat().st_size == 0 and not out.exists()
    report = regenerate(prompts, FakeEngine(), SETTINGS, out, progress=False)
    assert (report.num_reused, report.num_generated) == (0, 7)
    assert out.read_bytes() == fresh.read_bytes() and not partial.exists()
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [p.id for p in prompts]
