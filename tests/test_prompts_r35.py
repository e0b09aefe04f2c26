"""Review r35: the overlap check against near-duplicates that matter, checked independently."""

from __future__ import annotations

import random
import re

from draftforge.data.overlap import GramSequence, OverlapIndex, shingles
from draftforge.data.workloads import WORKLOAD_NAMES, load_workload

_OTHER_NAMES = ["Zofia", "Bruno", "Keira", "Ximena"]
_NOT_NAMES = {"If", "How", "What", "The", "She", "He", "Then", "They", "It", "In", "A", "At",
              "After", "Each", "On", "There", "Her", "His", "When", "This", "For", "Of"}


def _index() -> OverlapIndex:
    return OverlapIndex([(p.id, p.text) for w in WORKLOAD_NAMES for p in load_workload(w)], 0.5)


def test_every_gsm8k_problem_with_other_numbers_and_names_is_caught():
    """The same GSM8K problem with every number and every capitalised name changed is a copy."""
    index = _index()
    for p in load_workload("gsm8k"):
        text = re.sub(r"\d+", lambda m: str(int(m.group()) + 7), p.text)
        names = sorted(set(re.findall(r"\b[A-Z][a-z]+\b", p.text)) - _NOT_NAMES)
        for i, name in enumerate(names):
            text = re.sub(rf"\b{name}\b", _OTHER_NAMES[i % len(_OTHER_NAMES)], text)
        hit = index.query(text)
        assert hit is not None and hit[0] == p.id, (p.id, text, hit)


def test_the_last_prompts_of_each_workload_are_indexed_not_only_the_evaluated_first_n():
    index = _index()
    for name, count in (("humaneval", 164), ("mtbench", 80), ("gsm8k", 100)):
        prompts = load_workload(name)
        assert len(prompts) == count
        for p in prompts[-5:]:
            hit = index.query("Please help with this.\n" + p.messages[-1]["content"])
            assert hit is not None and hit[0] == p.id


def test_stretch_containment_agrees_with_brute_force_windows():
    rng = random.Random(1)
    for _ in range(500):
        alphabet = "ab c"[: rng.randint(2, 4)]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(6, 160)))
        ref = shingles("".join(rng.choice(alphabet) for _ in range(rng.randint(6, 40))))
        stride = rng.randint(1, 30)
        starts = len(text) - 4
        expected = max(
            len({text[i : i + 5] for i in range(k * stride, min(starts, (k + 2) * stride))} & ref)
            for k in range((starts - 1) // stride + 1)
        )
        assert GramSequence(text, shingles(text)).stretch_shared(ref, stride) == expected
