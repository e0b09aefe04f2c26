"""Training prompts must not overlap the evaluation workloads."""

from __future__ import annotations

import json
import random
import unicodedata

import pytest

from draftforge.data.config import DataConfig
from draftforge.data.formats import Conversation
from draftforge.data.loading import load_conversations, load_prompts, load_training_conversations
from draftforge.data.overlap import (
    OverlapError,
    OverlapIndex,
    check_no_overlap,
    normalize,
    shingles,
)
from draftforge.data.workloads import load_workload


def prompt(cid: str, text: str) -> Conversation:
    return Conversation(cid, [{"role": "user", "content": text}], source=f"test {cid}")


def light_edit(text: str) -> str:
    """Change two words, the case and the punctuation: still a copy."""
    words = text.split()
    words[1] = "someone"
    words[-3] = "several"
    return " ".join(words).upper().replace(",", ";")


@pytest.fixture(scope="module")
def shipped():
    return load_conversations(["builtin:train-prompts"]).conversations


def test_catches_exact_copy_and_light_edit(shipped):
    gsm = load_workload("gsm8k")[3]
    mt = load_workload("mtbench")[10]
    he = load_workload("humaneval")[20]
    bad = [
        prompt("exact", "  " + gsm.text + "  "),  # same after normalisation
        prompt("edited", light_edit(mt.text)),
        prompt("embedded", "Please help me with this:\n" + he.text + "\nThanks!"),
    ]
    with pytest.raises(OverlapError) as err:
        check_no_overlap(shipped[:100] + bad)
    hits = {h.train_id: h for h in err.value.hits}
    assert set(hits) == {"exact", "edited", "embedded"}
    assert (hits["exact"].eval_id, hits["exact"].kind) == (gsm.id, "exact")
    assert (hits["edited"].eval_id, hits["edited"].kind) == (mt.id, "near")
    assert hits["embedded"].eval_id == he.id
    message = str(err.value)
    assert message.startswith("3 training prompts overlap the evaluation workloads")
    assert f"training 'edited' (test edited) ~ eval '{mt.id}': near, score" in message


def test_second_user_turn_is_checked_too():
    gsm = load_workload("gsm8k")[0]
    conv = Conversation(
        "two", [{"role": "user", "content": "Hello"}, {"role": "user", "content": gsm.text}]
    )
    with pytest.raises(OverlapError):
        check_no_overlap([conv])


def test_shipped_prompt_set_passes(shipped):
    check_no_overlap(shipped, threshold=0.5)  # 2,400 x 344 texts; its speed is a benchmark's


def test_load_time_check_refuses_overlapping_training_file(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"prompt": "Tell me a joke."}, {"prompt": load_workload("gsm8k")[5].text}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(OverlapError, match=r"train-2.* ~ eval 'gsm8k-"):
        load_prompts(DataConfig(train_files=[str(path)]))
    assert (
        len(load_prompts(DataConfig(train_files=[str(path)], overlap_check=False)).conversations)
        == 2
    )


def reference_normalize(text: str) -> str:
    """The documented normalisation, re-derived character by character: NFKC, case-folded,
    every run of characters that are not letters or digits one space, no space at the ends."""
    out: list[str] = []
    for char in unicodedata.normalize("NFKC", text).casefold():
        if char.isalnum():
            out.append(char)
        elif out and out[-1] != " ":
            out.append(" ")
    return "".join(out).rstrip(" ")


def reference_shingles(text: str, n: int = 5) -> set[str]:
    """Every run of ``n`` consecutive characters; a shorter non-empty text is its own shingle."""
    if not text:
        return set()
    if len(text) <= n:
        return {text}
    grams = set()
    start = 0
    while start + n <= len(text):
        grams.add(text[start : start + n])
        start += 1
    return grams


def brute_force(train: list[str], refs: list[str], threshold: float) -> dict[int, float]:
    best = {}
    for i, text in enumerate(train):
        a = reference_shingles(reference_normalize(text))
        for ref in refs:
            b = reference_shingles(reference_normalize(ref))
            shared = len(a & b)
            score = max(shared / len(a | b), shared / len(b))
            if score >= threshold:
                best[i] = max(best.get(i, 0.0), score)
    return best


def test_normalize_and_shingles_give_the_documented_values():
    assert normalize("  Hello,  WORLD!! 42_x--") == "hello world 42 x"
    assert normalize("Ｆｕｌｌ－ｗｉｄｔｈ") == "full width"  # NFKC before case-folding
    assert normalize("Straße") == "strasse"  # case-folded, not just lower-cased
    assert normalize("...") == ""
    assert shingles("abcdefg") == frozenset({"abcde", "bcdef", "cdefg"})
    assert shingles("abcde") == frozenset({"abcde"})
    assert shingles("ab c") == frozenset({"ab c"})
    assert shingles("") == frozenset()
    assert shingles("aaaaaaa") == frozenset({"aaaaa"})
    assert shingles("abcd", n=2) == frozenset({"ab", "bc", "cd"})


def test_index_finds_exactly_what_brute_force_finds():
    rng = random.Random(0)
    refs = [p.text for p in load_workload("gsm8k")[:40]]
    vocab = sorted({w for r in refs for w in r.split()})
    train = []
    for _ in range(120):
        words = rng.choice(refs).split()
        # Replace a random share of the words: from near copies to unrelated text.
        share = rng.random()
        train.append(" ".join(rng.choice(vocab) if rng.random() < share else w for w in words))
    for threshold in (0.3, 0.5, 0.8):
        index = OverlapIndex([(str(i), r) for i, r in enumerate(refs)], threshold)
        expected = brute_force(train, refs, threshold)
        found = {}
        for i, text in enumerate(train):
            hit = index.query(text)
            if hit is not None:
                found[i] = hit[2]
        assert found.keys() == expected.keys()
        assert all(abs(found[i] - expected[i]) < 1e-12 for i in found)
        assert 0 < len(expected) < len(train)  # both outcomes occur


def test_full_width_copies_and_system_prompts_are_checked_too():
    """NFKC makes a full-width copy read as the plain text; an eval prompt placed in the system
    prompt is the eval prompt all the same."""
    question = load_workload("gsm8k")[0].text
    full_width = "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in question)
    assert normalize(full_width) == normalize(question)
    with pytest.raises(OverlapError):
        check_no_overlap([prompt("wide", full_width)], workloads=["gsm8k"])
    in_system = Conversation("sys", [{"role": "system", "content": question},
                                     {"role": "user", "content": "Solve the problem above."}], source="t")
    with pytest.raises(OverlapError):
        check_no_overlap([in_system], workloads=["gsm8k"])
    check_no_overlap([prompt("plain", "Write a haiku about autumn leaves.")], workloads=["gsm8k"])


def test_an_overlap_is_an_input_error_a_target_rank_reports_without_a_traceback():
    """Target ranks turn an InputError into one line and exit status 2 (not 1 and a restart)."""
    from draftforge.data.tokenize import ChatTemplateError
    from draftforge.data.workloads import WorkloadUnavailableError
    from draftforge.errors import InputError

    assert all(issubclass(e, InputError) for e in (OverlapError, ChatTemplateError, WorkloadUnavailableError))


def test_trained_assistant_replies_are_checked_when_the_files_are_trained_as_they_are(tmp_path):
    """With data.regenerate: false the files' assistant replies are what the draft learns, so a
    reply quoting a HumanEval prompt or stating a GSM8K problem leaks it like a user turn would;
    regenerated data replaces those replies, so the prompts alone are checked there."""
    he, gsm = load_workload("humaneval")[0], load_workload("gsm8k")[5]
    rows = [
        {"messages": [{"role": "user", "content": "Write a function for me."},
                      {"role": "assistant", "content": "```python\n" + he.text + "    return False\n```"}]},
        {"messages": [{"role": "user", "content": "Give me a word problem."},
                      {"role": "assistant", "content": gsm.text}]},
        {"messages": [{"role": "user", "content": "Tell me a joke."},
                      {"role": "assistant", "content": "Why did the chicken cross the road?"}]},
    ]  # fmt: skip
    path = tmp_path / "conv.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(train_files=[str(path)], regenerate=False)
    with pytest.raises(OverlapError) as err:
        load_training_conversations(cfg, tmp_path)
    hits = {h.train_id: h for h in err.value.hits}
    assert set(hits) == {"conv-1", "conv-2"}
    assert (hits["conv-1"].eval_id, hits["conv-2"].eval_id) == (he.id, gsm.id)
    assert hits["conv-2"].where == f"{path}, line 2, assistant turn"
    off = DataConfig(train_files=[str(path)], regenerate=False, overlap_check=False)
    assert len(load_training_conversations(off, tmp_path).conversations) == 3
    # the prompts of the same file, to be regenerated, are clean
    assert len(load_prompts(DataConfig(train_files=[str(path)])).conversations) == 3


def test_the_model_card_says_when_the_held_out_check_was_off():
    from pathlib import Path

    from draftforge.config import load_recipe
    from draftforge.train.export_cli import training_data_line

    tiny = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    warning = "Held-out check off (data.overlap_check: false): evaluation prompts may be in the training data."
    assert warning not in training_data_line(load_recipe(tiny))
    assert training_data_line(load_recipe(tiny, ["data.overlap_check=false"])).endswith(" " + warning)
