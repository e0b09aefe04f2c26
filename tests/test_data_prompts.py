"""The shipped training prompt set is the generator's output, large and varied."""

from __future__ import annotations

import ast
import collections
import gzip
import random
import typing

from draftforge.data import prompt_stubs, prompts
from draftforge.data.loading import load_conversations
from draftforge.data.overlap import eval_index, find_overlaps, normalize
from draftforge.data.workloads import WORKLOAD_NAMES


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


# Independent implementations of every stub in prompt_stubs: each example's result, as
# the prompt prints it, must be what the function described by the docstring returns.
def _reverse_words(sentence):
    return " ".join(reversed(sentence.split()))


def _is_balanced(text):
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for ch in text:
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack


def _top_k_words(text, k):
    counts = collections.Counter(text.split())
    return sorted(counts, key=lambda w: (-counts[w], w))[:k]


def _roman_to_int(numeral):
    values = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
    digits = [values[c] for c in numeral]
    return sum(-d if i + 1 < len(digits) and d < digits[i + 1] else d for i, d in enumerate(digits))


def _pairs_with_sum(values, target):
    found = {
        tuple(sorted((values[i], values[j])))
        for i in range(len(values))
        for j in range(i + 1, len(values))
        if values[i] + values[j] == target
    }
    return sorted(found)


def _group_anagrams(words):
    groups: dict = {}
    for w in words:
        groups.setdefault("".join(sorted(w)), []).append(w)
    return list(groups.values())


def _parse_duration(text):
    import re

    units = {"h": 3600, "m": 60, "s": 1}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([hms])", text))


def _is_ipv4(address):
    parts = address.split(".")
    return len(parts) == 4 and all(
        p.isdigit() and (p == "0" or not p.startswith("0")) and int(p) <= 255 for p in parts
    )


def _flatten(nested):
    return [y for x in nested for y in (_flatten(x) if isinstance(x, list) else [x])]


def _running_median(stream):
    import statistics

    return [float(statistics.median(stream[: i + 1])) for i in range(len(stream))]


def _count_islands(grid):
    seen, count = set(), 0
    for r, row in enumerate(grid):
        for c, cell in enumerate(row):
            if cell and (r, c) not in seen:
                count += 1
                todo = [(r, c)]
                while todo:
                    y, x = todo.pop()
                    if (y, x) in seen or not (0 <= y < len(grid) and 0 <= x < len(row)):
                        continue
                    if grid[y][x]:
                        seen.add((y, x))
                        todo += [(y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)]
    return count


def _run_length_encode(text):
    import itertools

    return "".join(f"{ch}{len(list(run))}" for ch, run in itertools.groupby(text))


def _edit_distance(a, b):
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def _shortest_path_length(graph, start, goal):
    frontier, dist = [start], {start: 0}
    for node in frontier:
        for nxt in graph.get(node, []):
            if nxt not in dist:
                dist[nxt] = dist[node] + 1
                frontier.append(nxt)
    return dist.get(goal, -1)


def _has_cycle(graph):
    state: dict = {}

    def visit(n):
        state[n] = 1
        for m in graph.get(n, []):
            if state.get(m) == 1 or (m not in state and visit(m)):
                return True
        state[n] = 2
        return False

    return any(n not in state and visit(n) for n in graph)


def _human_size(num_bytes):
    size, units = float(num_bytes), ["B", "KB", "MB", "GB", "TB"]
    while size >= 1024 and units[1:]:
        size, units = size / 1024, units[1:]
    return f"{size:.1f} {units[0]}"


def _digital_root(n):
    while n >= 10:
        n = sum(int(d) for d in str(n))
    return n


def _max_slice_sum(values):
    return max(sum(values[i:j]) for i in range(len(values)) for j in range(i + 1, len(values) + 1))


def _eval_postfix(tokens):
    import operator

    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
    stack: list = []
    for t in tokens:
        if t in ops:
            b, a = stack.pop(), stack.pop()
            stack.append(ops[t](a, b))
        else:
            stack.append(float(t))
    return stack[0]


def _first_unique_char(text):
    counts = collections.Counter(text)
    return next((ch for ch in text if counts[ch] == 1), "")


def _merge_intervals(intervals):
    out: list = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def _weekday_name(year, month, day):
    import calendar

    return calendar.day_name[calendar.weekday(year, month, day)]


def _count_letters(text):
    letters = [c for c in text.lower() if c.isalpha()]
    vowels = sum(c in "aeiou" for c in letters)
    return vowels, len(letters) - vowels


def _interval_overlap(first, second):
    low, high = max(first[0], second[0]), min(first[1], second[1])
    return (low, high) if low <= high else None


REFERENCES = {
    "reverse_words": _reverse_words,
    "is_balanced": _is_balanced,
    "top_k_words": _top_k_words,
    "merge_sorted": lambda a, b: sorted(a + b),
    "common_prefix": lambda words: __import__("os").path.commonprefix(words),
    "roman_to_int": _roman_to_int,
    "pairs_with_sum": _pairs_with_sum,
    "rotate_clockwise": lambda m: [list(r) for r in zip(*m[::-1], strict=True)],
    "group_anagrams": _group_anagrams,
    "parse_duration": _parse_duration,
    "is_ipv4": _is_ipv4,
    "pascal_row": lambda n: [__import__("math").comb(n, k) for k in range(n + 1)],
    "flatten": _flatten,
    "running_median": _running_median,
    "count_islands": _count_islands,
    "insertion_point": lambda items, value: __import__("bisect").bisect_left(items, value),
    "run_length_encode": _run_length_encode,
    "is_power_of_two": lambda n: n > 0 and n & (n - 1) == 0,
    "chunked": lambda items, size: [items[i : i + size] for i in range(0, len(items), size)],
    "edit_distance": _edit_distance,
    "shortest_path_length": _shortest_path_length,
    "has_cycle": _has_cycle,
    "human_size": _human_size,
    "digital_root": _digital_root,
    "primes_below": lambda n: [p for p in range(2, n) if all(p % d for d in range(2, p))],
    "max_slice_sum": _max_slice_sum,
    "snake_to_camel": lambda s: s.split("_")[0] + "".join(w.title() for w in s.split("_")[1:]),
    "eval_postfix": _eval_postfix,
    "moving_average": lambda v, w: [sum(v[i : i + w]) / w for i in range(len(v) - w + 1)],
    "columns_of": lambda rows: [list(c) for c in zip(*rows, strict=True)],
    "first_unique_char": _first_unique_char,
    "merge_intervals": _merge_intervals,
    "to_binary": lambda n: format(n, "b"),
    "weekday_name": _weekday_name,
    "count_letters": _count_letters,
    "interval_overlap": _interval_overlap,
}


def test_every_stub_example_matches_an_independent_implementation():
    assert set(REFERENCES) == {stub.name for stub in prompt_stubs.STUBS}
    for stub in prompt_stubs.STUBS:
        for args, result in stub.examples:
            got = eval(f"reference({args})", {"reference": REFERENCES[stub.name]})
            assert repr(got) == result, f"{stub.name}({args}) is {got!r}, the prompt says {result}"


def test_rendered_stubs_are_valid_python_with_their_examples():
    rng = random.Random(0)
    seen = set()
    for _ in range(400):
        stub = rng.choice(prompt_stubs.STUBS)
        code = prompt_stubs.render_stub(stub, rng)
        tree = ast.parse(code)  # a syntax error fails here
        func = tree.body[-1]
        assert isinstance(func, ast.FunctionDef) and func.name == stub.name
        assert [a.arg for a in func.args.args] == [name for name, _ in stub.params]
        docstring = ast.get_docstring(func)
        assert " ".join(docstring.split()).startswith(" ".join(stub.doc.split()))
        seen.add((func.returns is not None, "from typing" in code, ">>>" in code))
        if func.returns is not None:  # annotations resolve against typing and builtins
            namespace: dict = {}
            exec(compile(tree, "<stub>", "exec"), namespace)
            typing.get_type_hints(namespace[stub.name])
    # every surface variant occurs: with and without annotations, typing, examples
    assert seen == {
        (True, True, True),
        (True, True, False),
        (True, False, True),
        (True, False, False),
        (False, False, True),
        (False, False, False),
    }


def test_shipped_set_has_completion_requests_without_eval_overlap():
    convs = load_conversations(["builtin:train-prompts"]).conversations
    stubs = [c for c in convs if "```python\n" in c.user_turns[0] and '"""' in c.user_turns[0]]
    assert len(stubs) >= 100
    names = {s.name for s in prompt_stubs.STUBS}
    used = {n for n in names if any(f"def {n}(" in c.user_turns[0] for c in stubs)}
    assert used == names
    assert not find_overlaps(convs, eval_index(WORKLOAD_NAMES, 0.5))
