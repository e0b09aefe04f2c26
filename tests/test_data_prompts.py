"""The shipped training prompt set is the generator's output, large and varied."""

from __future__ import annotations

import collections
import gzip

from draftforge.data import prompts
from draftforge.data.loading import load_conversations
from draftforge.data.overlap import normalize


def test_shipped_file_equals_generator_output():
    with gzip.open(prompts.OUTPUT, "rb") as handle:
        shipped = handle.read()
    assert shipped == prompts.serialize(prompts.generate_prompts()), (
        "data/prompts/train-prompts.jsonl.gz is stale: run python -m draftforge.data.prompts"
    )


def test_generator_is_deterministic_and_rewrites_identically(tmp_path):
    assert prompts.generate_prompts(50, seed=3) == prompts.generate_prompts(50, seed=3)
    assert prompts.generate_prompts(50, seed=3) != prompts.generate_prompts(50, seed=4)
    out = prompts.write_prompts(tmp_path / "p.jsonl.gz", prompts.generate_prompts(30))
    again = prompts.write_prompts(tmp_path / "q.jsonl.gz", prompts.generate_prompts(30))
    assert out.read_bytes() == again.read_bytes()  # no timestamp in the gzip header


def test_set_is_large_varied_and_loads_as_builtin():
    convs = load_conversations(["builtin:train-prompts"]).conversations
    assert len(convs) >= 2000
    texts = [normalize(" ".join(c.user_turns)) for c in convs]
    assert len(set(texts)) == len(texts)
    categories = collections.Counter(c.extra["category"] for c in convs)
    assert set(categories) == {"math", "coding", "question", "writing"}
    assert min(categories.values()) >= 300
    assert sum(1 for c in convs if c.system) >= 100
    assert sum(1 for c in convs if len(c.user_turns) > 1) >= 100
    # Varied content, not a handful of templates with one slot.
    first_words = collections.Counter(" ".join(t.split()[:3]) for t in texts)
    assert len(first_words) >= 150
    assert first_words.most_common(1)[0][1] < 0.1 * len(texts)
    languages = {
        lang for lang in prompts.LANGUAGES if any(f" {lang} " in c.user_turns[0] for c in convs)
    }
    assert len(languages) >= 12
