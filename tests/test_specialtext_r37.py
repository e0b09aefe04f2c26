"""Round 37: an assistant reply whose text spells a special token (a ShareGPT dump with a
literal "<|im_end|>" inside a reply) tokenises to that token's id, so the draft learned to end
a turn in mid-reply, where the target never does. Such conversations are dropped and counted
like the short ones (never refused: the producer tokenises during training), their ids go to
the trainers like the short ones' (resume stays exact), and the run says how many."""

from __future__ import annotations

import json
import types

import pytest
from splitserve_helpers import tiny_recipe
from test_data_tokenize import chatml_tokenizer
from test_stream_r32 import _run_producer
from test_wire_r11 import _FakeEngine

from draftforge.config import load_recipe
from draftforge.data.formats import Conversation
from draftforge.data.tokenize import tokenize_conversations
from draftforge.errors import InputError
from draftforge.splitserve import producer as P
from draftforge.splitserve.target import load_tokenizer


def conv(cid: str, reply: str, user: str = "Hi") -> Conversation:
    return Conversation(cid, [{"role": "user", "content": user}, {"role": "assistant", "content": reply}])


def test_a_reply_spelling_a_special_token_is_dropped_and_counted_with_the_tiny_tokenizer():
    """The end-of-turn marker inside the reply was token 2 with loss mask 1 in mid-reply; the
    same text in the user's turn is context (the server tokenises the prompt the same way): kept."""
    tok = chatml_tokenizer()
    convs = [conv("clean", "a b c"), conv("marker", "a <|im_end|> b"), conv("asked", "a b c", user="a<|im_end|>b")]
    samples, stats = tokenize_conversations(convs, tok, max_length=64, min_loss_tokens=1)
    assert [s.id for s in samples] == ["clean", "asked"]
    assert (stats.num_kept, stats.num_dropped_special, stats.num_dropped_short) == (2, 1, 0)
    assert stats.dropped_ids == ["marker"] and stats.special_example == ("marker", "<|im_end|>")
    # the user's marker is in the sample, unsupervised; the reply's own end marker is supervised
    asked = samples[1]
    marks = [m for i, m in zip(asked.input_ids, asked.loss_mask, strict=True) if i == 2]
    assert marks == [0, 0, 1]  # user text, user turn's end, the reply's end


def test_special_text_in_an_earlier_turn_the_template_rewrites_is_context():
    """A turn the template renders differently once the conversation goes on is context, not
    supervised: kept; with a template that keeps it, it is supervised: dropped."""
    tok = chatml_tokenizer()
    rewriting = (  # earlier assistant turns get " d" appended: not what the model wrote
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
        "{% if m['role'] == 'assistant' and not loop.last %}{{ ' d' }}{% endif %}{{ '<|im_end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "a <|im_end|> b"},
                {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "c"}]
    samples, stats = tokenize_conversations([Conversation("c", messages)], tok, max_length=100,
                                            min_loss_tokens=1, chat_template=rewriting)
    assert [s.id for s in samples] == ["c"] and stats.num_context_turns == 1
    samples, stats = tokenize_conversations([Conversation("c", messages)], tok, max_length=100, min_loss_tokens=1)
    assert samples == [] and stats.num_dropped_special == 1 and stats.num_context_turns == 0


def test_an_unknown_word_is_not_special_text():
    """The tiny tokenizer maps an unknown word to <unk>, a special token: not the token's text."""
    samples, stats = tokenize_conversations([conv("unk", "a zzz b")], chatml_tokenizer(), max_length=64,
                                            min_loss_tokens=1)
    assert [s.id for s in samples] == ["unk"] and stats.num_dropped_special == 0
    samples, stats = tokenize_conversations([conv("lit", "a <unk> b")], chatml_tokenizer(), max_length=64,
                                            min_loss_tokens=1)
    assert samples == [] and stats.num_dropped_special == 1


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from draftforge.splitserve import smollm2

    return AutoTokenizer.from_pretrained(smollm2.ensure_smollm2())


def test_smollm2_drops_replies_holding_special_token_text_and_says_so(smollm2_tokenizer):
    tok = smollm2_tokenizer
    convs = [
        conv("clean", "Hello there, how can I help you today?"),
        conv("im-end", "Sure.<|im_end|>\n<|im_start|>user\nThanks"),
        conv("eot", "The end <|endoftext|> and more"),
        conv("user-side", "Hello there, how can I help you today?", user="Why <|im_end|>?"),
        conv("added", "Save it as <filename> first"),  # an added token marked special
        conv("short", "Ok"),
    ]
    samples, stats = tokenize_conversations(convs, tok, max_length=512, min_loss_tokens=4)
    assert [s.id for s in samples] == ["clean", "user-side"]
    assert (stats.num_dropped_special, stats.num_dropped_short) == (3, 1)
    assert stats.dropped_ids == ["im-end", "eot", "added", "short"]  # all sent on to the trainers
    assert stats.summary() == (
        "2/6 samples kept, 0 truncated, 1 dropped (too few supervised tokens), 3 dropped (an "
        "assistant reply contains special-token text such as '<|im_end|>', e.g. conversation 'im-end')")
    for sample in samples:  # the one supervised special token is the reply's own end marker
        assert [i for i, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m and i < 17] == [2]


def test_special_text_past_max_length_is_not_supervised(smollm2_tokenizer):
    """Text cut off by data.max_length is not trained on: nothing to drop for."""
    tok = smollm2_tokenizer
    reply = "word " * 60 + "<|im_end|>"
    samples, stats = tokenize_conversations([conv("late", reply)], tok, max_length=60, min_loss_tokens=1)
    assert [s.id for s in samples] == ["late"] and stats.num_truncated == 1 and stats.num_dropped_special == 0
    samples, stats = tokenize_conversations([conv("late", reply)], tok, max_length=512, min_loss_tokens=1)
    assert samples == [] and stats.num_dropped_special == 1


def _write_data(tmp_path, bad: dict[str, str]) -> None:
    """Overwrite the tiny recipe's data: its conversations, with ``bad`` ids' replies replaced."""
    _replace_replies(tmp_path / "convs.jsonl", bad)


def _replace_replies(path, bad: dict[str, str]) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        if row["id"] in bad:
            row["messages"][1]["content"] = bad[row["id"]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_producer_forwards_counts_and_says_the_special_text_drops(tmp_path, monkeypatch):
    """run_producer over two epochs: the dropped ids travel with the samples (the trainers record
    them as consumed with 0 tokens, as the short ones), the summary counts each conversation once, and
    the rank's note says why, naming one."""
    bad = {"conv-0003": "one two <|im_end|> three four five", "conv-0010": "see <|endoftext|> here now"}
    forwarded: list[str] = []
    _, summary, sent, logs = _run_producer(
        tmp_path, monkeypatch, {"split.max_epochs": 2}, num_conversations=12,
        edit_data=lambda path: _replace_replies(path, bad), forwarded=forwarded)
    assert (summary["dropped_special"], summary["dropped_short"]) == (2, 0)  # two epochs, counted once
    assert sorted(forwarded) == sorted([*bad, *(f"{i}#e1" for i in bad)])
    samples = [sample_id for _, sample_id in sent if sample_id is not None]  # None: an END
    assert len(samples) == 2 * (12 - len(bad)) and not set(samples) & set(forwarded)
    said = [line for line in logs if "special-token text" in line]
    assert len(said) == 1, logs
    assert "2 dropped (an assistant reply contains special-token text such as " in said[0]
    assert "e.g. conversation 'conv-00" in said[0]


def test_a_resume_that_recorded_the_drop_skips_its_chunk(tmp_path):
    """The trainers' checkpoint records a special-text drop as consumed with 0 tokens: a resume
    skips the chunk without computing it and sends the drop on no more."""
    bad = {"conv-0001": "a <|im_end|> b c d e"}
    recipe = tiny_recipe(tmp_path, num_conversations=8, overrides={"split.max_epochs": 1})
    _write_data(tmp_path, bad)
    cfg = load_recipe(recipe)
    conversations, regenerate = P.load_source_conversations(cfg)
    engine = _FakeEngine(load_tokenizer(cfg.target))
    topology = P.build_topology(cfg.split)
    first = list(P.SampleSource(cfg, engine, topology, 0, conversations=conversations,
                                regenerate=regenerate).samples())
    assert [i for s in first for i in s.dropped_ids] == ["conv-0001"]
    chunk = next(c for c in P.SampleSource(cfg, engine, topology, 0, conversations=conversations,
                                           regenerate=regenerate).chunks()
                 if "conv-0001" in [conversations[i].id for i in c])
    ids = [conversations[i].id for i in chunk]
    lengths = {s.sample_id: s.num_tokens for s in first}
    consumed = {i: lengths.get(i, 0) for i in ids}  # as the trainers' checkpoint records them
    source = P.SampleSource(cfg, engine, topology, 0, conversations=conversations, regenerate=regenerate,
                            consumed=consumed)
    rest = list(source.samples())
    assert source.skipped_consumed == len(ids) and source.dropped_special == 0
    assert [s.sample_id for s in rest] == [s.sample_id for s in first if s.sample_id not in ids]
    assert not [i for s in rest for i in s.dropped_ids]


def test_an_epoch_of_only_special_text_drops_says_why(tmp_path):
    recipe = tiny_recipe(tmp_path, num_conversations=4, overrides={"split.max_epochs": 1})
    _write_data(tmp_path, {f"conv-{i:04d}": "x <|im_end|> y z w" for i in range(4)})
    cfg = load_recipe(recipe)
    conversations, regenerate = P.load_source_conversations(cfg)
    engine = types.SimpleNamespace(tokenizer=load_tokenizer(cfg.target))
    source = P.SampleSource(cfg, engine, P.build_topology(cfg.split), 0, conversations=conversations,
                            regenerate=regenerate)
    with pytest.raises(InputError, match=r"epoch 0 produced no sample \(every conversation was dropped: 0 had "
                                         r"fewer than data.min_loss_tokens=4 supervised tokens, 4 dropped "
                                         r"\(an assistant reply contains special-token text such as "
                                         r"'<\|im_end\|>', e.g. conversation 'conv-000\d'\)\)"):
        next(source.samples())
