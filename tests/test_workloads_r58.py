"""Session 58: MT-Bench's first prompts span its categories.

The package's question.jsonl groups its 80 questions by category, 10 each, writing first, and
the evaluator takes the first ``--num-prompts`` (8 in the recipes): every MT-Bench figure was
the writing category's. The prompts now come in rounds over the categories.
"""

from __future__ import annotations

import json

from draftforge.data.workloads import load_workload, workload_file


def test_the_first_eight_are_one_of_each_category_and_all_eighty_stay():
    rows = [json.loads(line) for line in workload_file("mtbench").read_text().splitlines() if line.strip()]
    category = {f"mtbench/{row['question_id']}": row["category"] for row in rows}
    assert [category[f"mtbench/{i}"] for i in (81, 82, 90, 91)] == ["writing"] * 3 + ["roleplay"]  # as filed
    prompts = load_workload("mtbench")
    assert sorted(p.id for p in prompts) == sorted(category)  # all 80, each once
    names = list(dict.fromkeys(row["category"] for row in rows))
    assert len(names) == 8
    # by hand: round k holds each category's k-th question, categories in the file's order
    for k in range(10):
        assert [category[p.id] for p in prompts[8 * k: 8 * k + 8]] == names
    first_of = {name: next(row for row in rows if row["category"] == name) for name in names}
    assert [p.text for p in prompts[:8]] == [first_of[name]["turns"][0] for name in names]


def test_a_prompts_file_workload_name_with_white_space_around_it_is_refused(tmp_path):
    """" humaneval" and "humaneval" became two workloads whose report rows read alike."""
    import pytest

    from draftforge.errors import InputError
    from draftforge.eval.cli import _prompts_from_file

    rows = tmp_path / "p.jsonl"
    rows.write_text('{"workload": "humaneval", "input_ids": [1, 2]}\n'
                    '{"workload": " humaneval", "input_ids": [3]}\n')
    with pytest.raises(InputError, match=r'p.jsonl:2: workload " humaneval" begins or ends with white '
                                         r'space; write "humaneval"'):
        _prompts_from_file(str(rows), None)
    rows.write_text('{"workload": "humaneval", "input_ids": [1, 2]}\n')
    assert _prompts_from_file(str(rows), None) == ({"humaneval": [[1, 2]]}, {"humaneval": [1]})
