"""Training supervises the token ids the target generated, not its reply's text tokenised
again (review round 62). Regeneration stored each reply as text and tokenisation encoded that
text anew; a byte-level BPE spells some text otherwise than the target generated it: SmolLM2
writes the single token ``ĊĊ`` before a list item, and ``"\\n\\n1."`` tokenises as ``Ċ``, ``Ċ``,
``1``. In 48 answers to the CPU recipe's prompts 8 of 54 turns differed (a review's count), so
the draft was taught ``Ċ`` where the target emits ``ĊĊ``."""

from __future__ import annotations

import json

import pytest
from regenerate_helpers import FakeEngine, make_prompts

from draftforge.data.formats import Conversation, DataFormatError
from draftforge.data.loading import load_conversations
from draftforge.data.regenerate import regenerate
from draftforge.data.tokenize import tokenize_conversations, tokenize_messages
from draftforge.splitserve.target import Reply


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from draftforge.splitserve import smollm2

    return AutoTokenizer.from_pretrained(smollm2.ensure_smollm2())


def _supervised(tok, ids, mask) -> list[str]:
    return tok.convert_ids_to_tokens([i for i, m in zip(ids, mask, strict=True) if m])


LIST = "Sure:\n\n1. Trees\n2. Roofs"
AS_GENERATED = ["Sure", ":", "ĊĊ", "1", ".", "ĠTrees", "Ċ", "2", ".", "ĠR", "oo", "fs"]


@pytest.mark.integration
def test_a_reply_is_supervised_as_the_target_generated_it(tok):
    messages = [{"role": "user", "content": "Where does heat build up?"}, {"role": "assistant", "content": LIST}]
    generated = tok.convert_tokens_to_ids(AS_GENERATED)
    assert tok.decode(generated) == LIST
    as_text = tokenize_messages(tok, messages)
    as_generated = tokenize_messages(tok, messages, reply_token_ids=[None, generated])
    assert _supervised(tok, *as_text)[:4] == ["Sure", ":", "Ċ", "Ċ"]  # the text tokenised again
    assert _supervised(tok, *as_generated) == [*AS_GENERATED, "<|im_end|>"]
    # the prompt before it is the same tokens either way
    prompt = as_text[1].index(1)
    assert as_generated[1].index(1) == prompt and as_generated[0][:prompt] == as_text[0][:prompt]
    # a reply cut at max_new_tokens: its ids alone, no end-of-turn marker
    cut = tok.convert_tokens_to_ids(["Sure", ":", "Ċ", "Ċ"])  # "\n\n" at its end: generated apart
    messages[1]["content"] = "Sure:\n\n"
    assert _supervised(tok, *tokenize_messages(tok, messages, unfinished_turns=[1])) == ["Sure", ":", "ĊĊ"]
    assert _supervised(tok, *tokenize_messages(tok, messages, unfinished_turns=[1],
                                               reply_token_ids=[None, cut])) == ["Sure", ":", "Ċ", "Ċ"]


@pytest.mark.integration
def test_ids_that_do_not_spell_the_reply_leave_it_tokenised_from_its_text(tok):
    messages = [{"role": "user", "content": "Where?"}, {"role": "assistant", "content": LIST}]
    other = tok.convert_tokens_to_ids(["Sure", ":", "ĊĊ", "2"])  # edited by hand, or another reply's
    assert tokenize_messages(tok, messages, reply_token_ids=[None, other]) == tokenize_messages(tok, messages)


@pytest.mark.integration
def test_each_turn_of_a_conversation_takes_its_own_ids(tok):
    first, second = "Sure:\n\n1. Trees", "Then:\n\n2. Roofs"
    messages = [{"role": "user", "content": "One?"}, {"role": "assistant", "content": first},
                {"role": "user", "content": "Two?"}, {"role": "assistant", "content": second}]
    ids_1 = tok.convert_tokens_to_ids(["Sure", ":", "ĊĊ", "1", ".", "ĠTrees"])
    ids_2 = tok.convert_tokens_to_ids(["Then", ":", "ĊĊ", "2", ".", "ĠR", "oo", "fs"])
    assert tok.decode(ids_1) == first and tok.decode(ids_2) == second
    ids, mask = tokenize_messages(tok, messages, reply_token_ids=[None, ids_1, None, ids_2])
    end = tok.convert_tokens_to_ids("<|im_end|>")
    turns, run = [], []
    for token, supervised in zip(ids, mask, strict=True):
        if supervised:
            run.append(token)
        elif run:
            turns, run = [*turns, run], []
    assert turns + ([run] if run else []) == [ids_1 + [end], ids_2 + [end]]


def test_a_regenerated_row_records_the_ids_beside_its_messages(tmp_path):
    class IdsEngine(FakeEngine):
        def generate(self, conversations, settings):
            return [Reply(text, token_ids=[len(c), 7]) for c, text in zip(conversations, super().generate(
                conversations, settings), strict=True)]

    out = tmp_path / "answers.jsonl"
    prompts = make_prompts(4)  # p00: a system prompt and two user turns
    regenerate(prompts, IdsEngine(), _settings(), out, progress=False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [m["role"] for m in rows[0]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert rows[0]["reply_token_ids"] == [None, None, [2, 7], None, [4, 7]]
    assert rows[1]["reply_token_ids"] == [None, [1, 7]]
    conversations = load_conversations([str(out)], expect="conversation").conversations
    assert conversations[0].extra["reply_token_ids"] == [None, None, [2, 7], None, [4, 7]]
    # an engine that reports no ids writes no key (such rows are tokenised from their text)
    plain = tmp_path / "plain.jsonl"
    regenerate(prompts, FakeEngine(), _settings(), plain, progress=False)
    assert all("reply_token_ids" not in json.loads(line) for line in plain.read_text().splitlines())


def _settings():
    from regenerate_helpers import SETTINGS

    return SETTINGS


@pytest.mark.parametrize("value", [[None, [1, 2], None], [[1], [2]], [None, [-1]], [None, [True]], [None, "12"], 5])
def test_reply_token_ids_that_do_not_fit_the_messages_are_refused_naming_the_row(tmp_path, value):
    path = tmp_path / "answers.jsonl"
    path.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "Hi"},
                                                        {"role": "assistant", "content": "Hello"}],
                                "reply_token_ids": value}) + "\n")
    with pytest.raises(DataFormatError, match=rf"{path}, line 1: reply_token_ids must be a list beside the 2 "
                                              "messages"):
        load_conversations([str(path)], expect="conversation")


def test_a_top_level_system_key_shifts_the_ids_with_the_messages(tmp_path):
    path = tmp_path / "answers.jsonl"
    path.write_text(json.dumps({"id": "a", "system": "Be brief.", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        "reply_token_ids": [None, [5, 6]]}) + "\n")
    conversation = load_conversations([str(path)], expect="conversation").conversations[0]
    assert [m["role"] for m in conversation.messages] == ["system", "user", "assistant"]
    assert conversation.extra["reply_token_ids"] == [None, None, [5, 6]]


@pytest.mark.integration
def test_regenerated_answers_train_on_exactly_the_ids_the_real_target_generated(tmp_path):
    """The whole path on SmolLM2-135M-Instruct with the CPU recipe's sampling: answered, written,
    read back as training reads them, tokenised; every supervised turn is the generated ids."""
    from draftforge.config import load_recipe
    from draftforge.splitserve.target import build_target

    cfg = load_recipe("recipes/smollm2-cpu.yaml")
    settings = cfg.target.generation.model_copy(update={"max_new_tokens": 96, "batch_size": 17})
    engine = build_target(cfg.target.model_copy(update={"num_threads": 1}), cfg.draft.target_layer_ids)
    generated = {}
    answer = engine.generate_token_ids

    def spy(conversations, call_settings):
        replies = answer(conversations, call_settings)
        for conversation, ids in zip(conversations, replies, strict=True):
            generated[json.dumps(conversation)] = ids
        return replies

    engine.generate_token_ids = spy
    # among the first 16 prompts' answers at 96 tokens, two are spelt otherwise by their text
    # tokenised again (the urban heat islands answer's "include:\n\n1.", generated as ĊĊ, 1;
    # a Rust answer's "&mutable", generated as mut, able)
    prompts = load_conversations(["builtin:train-prompts"], limit=16, expect="prompt").conversations
    prompts.append(Conversation("two-turns", [{"role": "user", "content": "List three fruits."},
                                              {"role": "user", "content": "Now three colours, as a list."}]))
    out = tmp_path / "answers.jsonl"
    regenerate(prompts, engine, settings, out, progress=False)
    conversations = load_conversations([str(out)], expect="conversation").conversations
    samples, _ = tokenize_conversations(conversations, engine.tokenizer, max_length=100_000, min_loss_tokens=1)
    assert len(samples) == len(prompts)
    eos = set(engine.eos_token_ids())
    turns = 0
    for sample, conversation in zip(samples, conversations, strict=True):
        runs, run = [], []
        for token, supervised in zip(sample.input_ids, sample.loss_mask, strict=True):
            if supervised:
                run.append(token)
            elif run:
                runs, run = [*runs, run], []
        runs += [run] if run else []
        assistant = [i for i, m in enumerate(conversation.messages) if m["role"] == "assistant"]
        assert len(runs) == len(assistant), sample.id
        for index, supervised in zip(assistant, runs, strict=True):
            ids = generated[json.dumps(conversation.messages[:index])]
            finished = bool(ids) and ids[-1] in eos
            # a cut reply ending inside a character keeps its whole characters' ids only
            expected = ids if finished else list(conversation.extra["reply_token_ids"][index])
            assert supervised == expected, (sample.id, index)
            assert finished or ids[: len(expected)] == expected
            turns += 1
    assert turns == sum(len(p.user_turns) for p in prompts) > len(prompts)  # later turns too


def _sentencepiece_like():
    """A tokenizer built here with a SentencePiece-style decoder as Mistral v0.3's and Llama 2's
    (pieces marked with ▁, one leading space stripped from the decoded text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", *(f"<0x{b:02X}>" for b in range(256))]
    core.train_from_iterator(["[INST] Hi there [/INST] Hello! Sure: fine, thanks."] * 40,
                             trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   additional_special_tokens=["[INST]", "[/INST]"])


def test_a_sentencepiece_reply_is_supervised_without_a_token_the_target_never_generated():
    """Mistral's template writes " " + reply; the target generates ▁Hello, which decodes alone to
    "Hello": matched there, the template's space became a lone ▁ token before the generated ids
    (review round 62). Spelt after the prompt, the ids cover the space as generated."""
    from test_tokenize_r33 import MISTRAL

    sp = _sentencepiece_like()
    generated = sp(" Hello!", add_special_tokens=False)["input_ids"]
    reply = sp.decode(generated, skip_special_tokens=True)
    assert sp.convert_ids_to_tokens(generated)[0].startswith("▁") and reply == "Hello!"
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}]
    ids, mask = tokenize_messages(sp, messages, chat_template=MISTRAL, reply_token_ids=[None, generated])
    assert [i for i, m in zip(ids, mask, strict=True) if m] == [*generated, sp.eos_token_id]
    assert (ids, mask) == tokenize_messages(sp, messages, chat_template=MISTRAL)  # as the text path here


@pytest.mark.integration
@pytest.mark.parametrize("bad", [10**6, 2**64])
def test_ids_with_a_token_the_tokenizer_lacks_leave_the_reply_as_text(tok, bad):
    """Hand-edited ids: one past the vocabulary was trained on (a fast tokenizer's decode skips
    it, so the rest still spelt the reply), one past 64 bits crashed naming no row (review
    round 62)."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    hello = tok("Hello", add_special_tokens=False)["input_ids"]
    assert tokenize_messages(tok, messages, reply_token_ids=[None, [*hello, bad]]) == \
        tokenize_messages(tok, messages)


@pytest.mark.integration
def test_ids_holding_a_special_token_in_mid_reply_are_dropped_as_the_text_is(tok):
    """A reply whose text spells <|im_end|> is dropped (the draft would learn to end a turn in
    mid-reply); given ids spelling it with that token, it was kept (review round 62)."""
    text = "😀<|im_end|>b"  # the emoji: pieces of a character, which decode apart to U+FFFD each
    conversation = Conversation("c", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": text}],
                                extra={"reply_token_ids": [None, tok(text, add_special_tokens=False)["input_ids"]]})
    assert tok.convert_tokens_to_ids("<|im_end|>") in conversation.extra["reply_token_ids"][1]
    samples, stats = tokenize_conversations([conversation], tok, max_length=100, min_loss_tokens=1)
    assert samples == [] and stats.num_dropped_special == 1
