"""``draftforge eval compare A [B]``: is one method's acceptance length really ahead of another's?

A and B are evaluation reports (``report.json`` or the folder holding it) of
the same prompts; B defaults to A, so one report's draft can be compared with
its own baselines (``--b-method ngram``). Each workload's difference
``AL(A) - AL(B)`` and their macro mean get a paired bootstrap interval over
prompts (:mod:`draftforge.eval.uncertainty`). The last line is machine-readable::

    diff_macro=<difference> low=<bound> high=<bound> verdict=<ahead|behind|not_distinguishable|too_few_prompts>
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from draftforge.errors import InputError
from draftforge.eval.uncertainty import DRAWS, LEVEL, SEED, PromptTotals, by_workload


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftforge eval compare",
        description="Paired bootstrap comparison of two methods' acceptance lengths on the same prompts.",
    )
    parser.add_argument("a", metavar="A", help="an eval report: report.json or the folder holding it")
    parser.add_argument("b", metavar="B", nargs="?", help="the report to compare against (default: A)")
    parser.add_argument("--a-method", default="dspark", help="method of A (default: dspark)")
    parser.add_argument(
        "--b-method", help="method of B (default: dspark when B is another report, else ngram)"
    )
    parser.add_argument("--draws", type=int, default=DRAWS, help=f"bootstrap draws (default: {DRAWS})")
    parser.add_argument("--level", type=float, default=LEVEL, help=f"interval level (default: {LEVEL})")
    parser.add_argument("--seed", type=int, default=SEED, help=f"bootstrap seed (default: {SEED})")
    return parser


def load_report(path: str) -> tuple[Path, dict]:
    """``report.json`` from a file or a folder, with errors that name the file."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "report.json"
    if not p.is_file():
        raise InputError(f"{p}: no such evaluation report (run draftforge eval --out DIR first)")
    try:
        report = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise InputError(f"{p}: not valid JSON (line {err.lineno}, column {err.colno}): {err.msg}") from None
    if not isinstance(report, dict) or not isinstance(report.get("workloads"), dict):
        raise InputError(f"{p}: not a draftforge eval report (no 'workloads' table)")
    return p, report


def paired_totals(
    a: tuple[Path, dict], a_method: str, b: tuple[Path, dict], b_method: str
) -> dict[str, tuple[PromptTotals, PromptTotals]]:
    """Per workload, the two methods' per-prompt totals, checked to be on the same prompts."""
    (pa, ra), (pb, rb) = a, b
    wa, wb = ra["workloads"], rb["workloads"]
    if set(wa) != set(wb):
        raise InputError(f"{pa} has workloads {sorted(wa)} but {pb} has {sorted(wb)}: compare the same ones")
    out = {}
    for name in wa:
        ea, eb = wa[name], wb[name]
        for path, entry, method in ((pa, ea, a_method), (pb, eb, b_method)):
            if method not in entry.get("methods", {}):
                raise InputError(
                    f"{path}: workload {name!r} has no method {method!r} "
                    f"(it has {sorted(entry.get('methods', {}))})"
                )
        da, db = ea.get("prompt_digest"), eb.get("prompt_digest")
        if not (da and db):
            raise InputError(
                f"workload {name!r}: {pa if not da else pb} records no prompt digest (an older "
                "draftforge eval wrote it), so nothing shows the two were measured on the same "
                "prompts; evaluate it again"
            )
        if ea.get("num_prompts") != eb.get("num_prompts") or da != db:
            raise InputError(
                f"workload {name!r}: {pa} and {pb} were measured on different prompts "
                f"({ea.get('num_prompts')} prompts, digest {da} against {eb.get('num_prompts')}, {db})"
            )
        out[name] = (
            PromptTotals.from_summary(ea["methods"][a_method], f"{pa}: {name}/{a_method}"),
            PromptTotals.from_summary(eb["methods"][b_method], f"{pb}: {name}/{b_method}"),
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.draws < 1:
        parser.error(f"--draws must be at least 1, got {args.draws}")
    if not 0 < args.level < 1:
        parser.error(f"--level must lie strictly between 0 and 1, got {args.level}")
    a = load_report(args.a)
    b = load_report(args.b) if args.b else a
    b_method = args.b_method or ("dspark" if args.b else "ngram")
    if b is a and b_method == args.a_method:
        raise InputError(f"comparing {args.a_method} with itself in one report: give B or --b-method")
    pairs = paired_totals(a, args.a_method, b, b_method)
    kw = {"draws": args.draws, "level": args.level, "seed": args.seed}
    print(
        f"eval compare: {a[0]} ({args.a_method}) minus {b[0]} ({b_method}), paired on the same "
        f"prompts; {args.level:.0%} bootstrap intervals over prompts, {args.draws} draws"
    )
    print("| workload | prompts | A | B | A - B (interval) | verdict |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    diffs = by_workload(pairs, **kw)
    groups = {**{name: [pair] for name, pair in pairs.items()}, "macro": list(pairs.values())}
    for name, group in groups.items():
        diff = diffs[name]
        al_a = sum(p.pooled() for p, _ in group) / len(group)
        al_b = sum(q.pooled() for _, q in group) / len(group)
        prompts = sum(len(p) for p, _ in group)
        print(
            f"| {name} | {prompts} | {al_a:.3f} | {al_b:.3f} | {diff.value:+.3f} "
            f"({diff.low:+.3f} to {diff.high:+.3f}) | {diff.verdict()} |"
        )
    print(
        f"diff_macro={diff.value:.4f} low={diff.low:.4f} high={diff.high:.4f} "
        f"verdict={diff.verdict().replace(' ', '_')}"
    )
    return 0
