"""Function stubs for the training prompts' "complete this function" requests.

A completion request shows a Python function's signature and docstring and asks for the
whole function back, so the answer restates the prompt's code before adding to it. That
copying is what n-gram prompt lookup does well and what a draft has to learn from its
training data; requests that only describe a task in words never show it.

Each stub is written here (no third-party text): a name, typed parameters, a return type,
a one-sentence description and examples whose results were worked out by hand and are
checked against independent implementations in ``tests/test_data_prompts.py``. The
rendering varies the surface a generator can vary -- annotations or none, built-in or
``typing`` generics, doctest examples or none, where the instruction sits -- from the
caller's seeded generator.
"""

from __future__ import annotations

import random
import re
import textwrap
from typing import NamedTuple


class Stub(NamedTuple):
    name: str
    params: tuple[tuple[str, str], ...]  # (name, annotation with built-in generics)
    returns: str
    doc: str
    examples: tuple[tuple[str, str], ...]  # (argument text, result repr)


STUBS: tuple[Stub, ...] = (
    Stub(
        "reverse_words",
        (("sentence", "str"),),
        "str",
        "Return the words of sentence in reverse order, keeping each punctuation mark "
        "attached to its word.",
        (("'hello, big world!'", "'world! big hello,'"),),
    ),
    Stub(
        "is_balanced",
        (("text", "str"),),
        "bool",
        "Return True if every bracket in text -- (), [] and {} -- is closed in the right "
        "order, and False otherwise.",
        (("'([]{})'", "True"), ("'([)]'", "False")),
    ),
    Stub(
        "top_k_words",
        (("text", "str"), ("k", "int")),
        "list[str]",
        "Return the k most frequent words of text, most frequent first, ties broken "
        "alphabetically.",
        (("'b a b c a b', 2", "['b', 'a']"),),
    ),
    Stub(
        "merge_sorted",
        (("left", "list[int]"), ("right", "list[int]")),
        "list[int]",
        "Merge two sorted lists into one sorted list without calling sort or sorted.",
        (("[1, 4, 9], [2, 3, 10]", "[1, 2, 3, 4, 9, 10]"),),
    ),
    Stub(
        "common_prefix",
        (("words", "list[str]"),),
        "str",
        "Return the longest prefix shared by every string in words, or an empty string "
        "when they share none.",
        (("['flower', 'flow', 'flight']", "'fl'"), ("['car', 'bus']", "''")),
    ),
    Stub(
        "roman_to_int",
        (("numeral", "str"),),
        "int",
        "Convert a Roman numeral such as 'XIV' to an integer. Raise ValueError when the "
        "numeral is not valid.",
        (("'XIV'", "14"), ("'MCMXC'", "1990")),
    ),
    Stub(
        "pairs_with_sum",
        (("values", "list[int]"), ("target", "int")),
        "list[tuple[int, int]]",
        "Return every pair (a, b) with a <= b, taken from two different positions of "
        "values, whose sum is target, sorted in ascending order.",
        (("[1, 5, 3, 7, 4], 8", "[(1, 7), (3, 5)]"),),
    ),
    Stub(
        "rotate_clockwise",
        (("matrix", "list[list[int]]"),),
        "list[list[int]]",
        "Return a square matrix rotated by 90 degrees clockwise.",
        (("[[1, 2], [3, 4]]", "[[3, 1], [4, 2]]"),),
    ),
    Stub(
        "group_anagrams",
        (("words", "list[str]"),),
        "list[list[str]]",
        "Group the words that are anagrams of each other. Groups appear in the order of "
        "their first word, and words keep their order inside a group.",
        (("['tea', 'eat', 'tan', 'ate', 'nat']", "[['tea', 'eat', 'ate'], ['tan', 'nat']]"),),
    ),
    Stub(
        "parse_duration",
        (("text", "str"),),
        "int",
        "Return the number of seconds in a duration written like '2h15m30s'. Each of the "
        "hours, minutes and seconds parts is optional.",
        (("'2h15m30s'", "8130"), ("'45m'", "2700")),
    ),
    Stub(
        "is_ipv4",
        (("address", "str"),),
        "bool",
        "Return True if address is a dotted IPv4 address: four decimal numbers from 0 to "
        "255 without leading zeros.",
        (("'192.168.0.1'", "True"), ("'256.1.1.1'", "False")),
    ),
    Stub(
        "pascal_row",
        (("n", "int"),),
        "list[int]",
        "Return row n of Pascal's triangle, counting the top row as row 0.",
        (("4", "[1, 4, 6, 4, 1]"),),
    ),
    Stub(
        "flatten",
        (("nested", "list"),),
        "list[int]",
        "Flatten a list of integers nested to any depth, keeping their order.",
        (("[1, [2, [3, 4]], 5]", "[1, 2, 3, 4, 5]"),),
    ),
    Stub(
        "running_median",
        (("stream", "list[float]"),),
        "list[float]",
        "Return, for every i, the median of the first i values of stream.",
        (("[5.0, 1.0, 3.0]", "[5.0, 3.0, 3.0]"),),
    ),
    Stub(
        "count_islands",
        (("grid", "list[list[int]]"),),
        "int",
        "Count the groups of 1s in a grid of 0s and 1s, where cells belong to the same "
        "group when they touch horizontally or vertically.",
        (("[[1, 1, 0], [0, 0, 1], [1, 0, 1]]", "3"),),
    ),
    Stub(
        "insertion_point",
        (("items", "list[int]"), ("value", "int")),
        "int",
        "Binary-search the sorted list items and return the index of value, or the index "
        "at which inserting value would keep the list sorted.",
        (("[1, 3, 5, 7], 5", "2"), ("[1, 3, 5, 7], 6", "3")),
    ),
    Stub(
        "run_length_encode",
        (("text", "str"),),
        "str",
        "Compress text with run-length encoding: each run of one character becomes the "
        "character followed by the length of the run.",
        (("'aaabcc'", "'a3b1c2'"),),
    ),
    Stub(
        "is_power_of_two",
        (("n", "int"),),
        "bool",
        "Return True if n is a positive power of two, using bit operations only.",
        (("64", "True"), ("12", "False")),
    ),
    Stub(
        "chunked",
        (("items", "list[int]"), ("size", "int")),
        "list[list[int]]",
        "Split items into consecutive chunks of the given size; the last chunk may be "
        "shorter.",
        (("[1, 2, 3, 4, 5], 2", "[[1, 2], [3, 4], [5]]"),),
    ),
    Stub(
        "edit_distance",
        (("source", "str"), ("target", "str")),
        "int",
        "Return the smallest number of single-character insertions, deletions and "
        "substitutions that turn source into target.",
        (("'kitten', 'sitting'", "3"),),
    ),
    Stub(
        "shortest_path_length",
        (("graph", "dict[str, list[str]]"), ("start", "str"), ("goal", "str")),
        "int",
        "Return the number of edges on a shortest path from start to goal in an unweighted "
        "graph given as adjacency lists, or -1 when goal cannot be reached.",
        (("{'a': ['b'], 'b': ['c'], 'c': []}, 'a', 'c'", "2"),),
    ),
    Stub(
        "has_cycle",
        (("graph", "dict[int, list[int]]"),),
        "bool",
        "Return True if the directed graph, given as adjacency lists, contains a cycle.",
        (("{0: [1], 1: [2], 2: [0]}", "True"), ("{0: [1], 1: []}", "False")),
    ),
    Stub(
        "human_size",
        (("num_bytes", "int"),),
        "str",
        "Format a number of bytes with one decimal and the largest unit among B, KB, MB, "
        "GB and TB that keeps the number at least 1 (1 KB is 1024 B).",
        (("3355443", "'3.2 MB'"), ("512", "'512.0 B'")),
    ),
    Stub(
        "digital_root",
        (("n", "int"),),
        "int",
        "Keep replacing the non-negative integer n by the sum of its decimal digits until a "
        "single digit remains, and return that digit.",
        (("9875", "2"),),
    ),
    Stub(
        "primes_below",
        (("n", "int"),),
        "list[int]",
        "Return every prime smaller than n, found with the sieve of Eratosthenes.",
        (("20", "[2, 3, 5, 7, 11, 13, 17, 19]"),),
    ),
    Stub(
        "max_slice_sum",
        (("values", "list[int]"),),
        "int",
        "Return the largest sum of a non-empty run of consecutive values.",
        (("[-2, 1, -3, 4, -1, 2, 1, -5, 4]", "6"),),
    ),
    Stub(
        "snake_to_camel",
        (("identifier", "str"),),
        "str",
        "Convert a snake_case identifier to camelCase.",
        (("'parse_http_header'", "'parseHttpHeader'"),),
    ),
    Stub(
        "eval_postfix",
        (("tokens", "list[str]"),),
        "float",
        "Evaluate an arithmetic expression in reverse Polish notation, where tokens are "
        "numbers and the operators +, -, * and /.",
        (("['3', '4', '+', '2', '*']", "14.0"),),
    ),
    Stub(
        "moving_average",
        (("values", "list[float]"), ("window", "int")),
        "list[float]",
        "Return the mean of every run of window consecutive values, in order.",
        (("[1.0, 2.0, 3.0, 4.0], 2", "[1.5, 2.5, 3.5]"),),
    ),
    Stub(
        "columns_of",
        (("rows", "list[list[int]]"),),
        "list[list[int]]",
        "Turn a list of equally long rows into the list of its columns.",
        (("[[1, 2, 3], [4, 5, 6]]", "[[1, 4], [2, 5], [3, 6]]"),),
    ),
    Stub(
        "first_unique_char",
        (("text", "str"),),
        "str",
        "Return the first character of text that occurs in it only once, or an empty "
        "string when every character repeats.",
        (("'swiss'", "'w'"), ("'abab'", "''")),
    ),
    Stub(
        "merge_intervals",
        (("intervals", "list[list[int]]"),),
        "list[list[int]]",
        "Merge the overlapping [start, end] intervals and return the result sorted by "
        "start.",
        (("[[8, 10], [1, 3], [2, 6]]", "[[1, 6], [8, 10]]"),),
    ),
    Stub(
        "to_binary",
        (("n", "int"),),
        "str",
        "Return the binary digits of a non-negative integer, without a prefix.",
        (("10", "'1010'"), ("0", "'0'")),
    ),
    Stub(
        "weekday_name",
        (("year", "int"), ("month", "int"), ("day", "int")),
        "str",
        "Return the English name of the weekday of a Gregorian date, without using a date "
        "library.",
        (("2024, 1, 1", "'Monday'"),),
    ),
    Stub(
        "count_letters",
        (("text", "str"),),
        "tuple[int, int]",
        "Return how many vowels and how many consonants text contains, ignoring case and "
        "every character that is not a letter.",
        (("'Hello, World'", "(3, 7)"),),
    ),
    Stub(
        "interval_overlap",
        (("first", "tuple[int, int]"), ("second", "tuple[int, int]")),
        "tuple[int, int] | None",
        "Return the intersection of two closed intervals, or None when they do not meet.",
        (("(1, 5), (3, 9)", "(3, 5)"), ("(1, 2), (4, 6)", "None")),
    ),
)

INSTRUCTIONS = (
    "Finish this Python function so that it does what its docstring says. Show the "
    "complete function.",
    "Fill in the body of the function below and give me the whole function back.",
    "Implement the following function. Return the full code, signature included.",
    "Here is a function stub. Write the implementation.",
    "Complete this function and briefly explain how it works.",
)

_GENERIC = re.compile(r"\b(list|dict|tuple)\[")


def _typing_style(annotation: str) -> tuple[str, set[str]]:
    """``annotation`` with ``typing`` generics (``List[int]``, ``Optional[...]``) and the
    names it then needs from ``typing``."""
    names = {m.group(1).capitalize() for m in _GENERIC.finditer(annotation)}
    text = _GENERIC.sub(lambda m: m.group(1).capitalize() + "[", annotation)
    if text.endswith(" | None"):
        text = f"Optional[{text[: -len(' | None')]}]"
        names.add("Optional")
    return text, names


def render_stub(stub: Stub, rng: random.Random) -> str:
    """The stub as Python source (signature and docstring, no body), surface varied by ``rng``."""
    annotate = rng.random() < 0.75
    use_typing = annotate and rng.random() < 0.4
    imports: set[str] = set()

    def annotation(text: str) -> str:
        if not use_typing:
            return text
        converted, names = _typing_style(text)
        imports.update(names)
        return converted

    if annotate:
        params = ", ".join(f"{name}: {annotation(kind)}" for name, kind in stub.params)
        signature = f"def {stub.name}({params}) -> {annotation(stub.returns)}:"
    else:
        signature = f"def {stub.name}({', '.join(name for name, _ in stub.params)}):"
    doc = textwrap.wrap(stub.doc, width=84)
    examples = rng.random() < 0.6
    lines = []
    if imports:
        lines += [f"from typing import {', '.join(sorted(imports))}", "", ""]
    lines.append(signature)
    if not examples and len(doc) == 1:
        lines.append(f'    """{doc[0]}"""')
    else:
        lines.append(f'    """{doc[0]}')
        lines += [f"    {line}" for line in doc[1:]]
        if examples:
            for args, result in stub.examples:
                lines += [f"    >>> {stub.name}({args})", f"    {result}"]
        lines.append('    """')
    return "\n".join(lines)


def completion_request(rng: random.Random) -> str:
    """A "complete this function" request around a randomly chosen, randomly rendered stub."""
    stub = rng.choice(STUBS)
    code = render_stub(stub, rng)
    instruction = rng.choice(INSTRUCTIONS)
    if rng.random() < 0.8:
        return f"{instruction}\n\n```python\n{code}\n```"
    return f"```python\n{code}\n```\n\n{instruction}"
