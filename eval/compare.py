"""``draftforge eval compare A [B]``: is one method's acceptance length really ahead of another's?

A and B are evaluation reports (``report.json`` or the folder holding it) of
the same prompts; B defaults to A, so one report's draft can be compared with
its own baselines (``--b-method ngram``). Each workload's difference
``AL(A) - AL(B)`` and their macro mean get a paired bootstrap interval over
prompts (:mod:`draftforge.eval.uncertainty`). The last line is machine-readable::

    diff_macro=<difference> low=<bound> high=<bound> verdict=<ahead|behind|not_distinguishable|too_few_prompts>

A draw that resampled only prompts on which A or B ran no verification round has no
difference; it is left out of the interval, and a note above that line says how many.

Two reports pair only when they were decoded alike (:func:`check_same_decoding`): the
same target (name, dtype, backend; seed and shape for a random one), temperature,
max_new_tokens and, when sampling, seed, top-k and top-p; for draft against draft the same
verification mode (and threshold) and, when sampling, the same way of drafting
(``--draft-sampling``); wherever n-gram takes part the same block size (its proposal
length) and n-gram order. The drafts themselves may differ. A mismatch is refused; a
setting that an older report does not record is named in a warning and left unchecked.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from draftforge import argtypes
from draftforge.errors import InputError
from draftforge.eval.uncertainty import (
    DRAWS,
    LEVEL,
    MIN_PROMPTS,
    SEED,
    Interval,
    PromptTotals,
    by_workload,
    expanded_level,
    expanded_tail,
    least_draws,
)

# The bootstrap holds draws x prompts resampled indices of a workload at once, and a gathered
# copy: about 16 bytes each, so this bounds its memory at about 1.6 GB.
MAX_RESAMPLED = 100_000_000


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftforge eval compare",
        description="Paired bootstrap comparison of two methods' acceptance lengths on the same prompts.",
    )
    parser.add_argument("a", metavar="A", help="an eval report: report.json or the folder holding it")
    parser.add_argument("b", metavar="B", nargs="?", help="the report to compare against (default: A)")
    parser.add_argument("--a-method", default="dspark", help="method of A (default: dspark)")
    parser.add_argument(
        "--b-method", help="method of B (default: dspark when B is given, else ngram; A's own report given again as B is refused at the default: a method compared with itself)"
    )
    parser.add_argument("--draws", type=int, default=DRAWS, help=f"bootstrap draws (default: {DRAWS}; more than that "
                        f"only up to {MAX_RESAMPLED:,} divided by the largest workload's prompts)")
    parser.add_argument("--level", type=float, default=LEVEL, help=f"interval level (default: {LEVEL})")
    parser.add_argument("--seed", type=argtypes.non_negative_int, default=SEED,
                        help=f"bootstrap seed, 0 or more (default: {SEED})")
    return parser


def load_report(path: str) -> tuple[Path, dict]:
    """``report.json`` from a file or a folder, with errors that name the file."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "report.json"
    if not p.is_file():
        raise InputError(f"{p}: no such evaluation report (run draftforge eval --out DIR first)")
    try:
        report = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:  # e.g. the report folder's acceptance_length.png
        raise InputError(f"{p}: not a text file (byte {err.start}: {err.reason}); give the report's "
                         "report.json or the folder holding it") from None
    except json.JSONDecodeError as err:
        # e.g. the report.md beside it: name the file this takes
        raise InputError(f"{p}: not valid JSON (line {err.lineno}, column {err.colno}): {err.msg}; give "
                         "the report's report.json or the folder holding it") from None
    except (ValueError, RecursionError) as err:  # too long an integer; nested too deeply
        raise InputError(f"{p}: not a readable report ({err or 'JSON nested too deeply'}); give the report's "
                         "report.json or the folder holding it") from None
    if not isinstance(report, dict) or not isinstance(report.get("workloads"), dict):
        raise InputError(f"{p}: not a draftforge eval report (no 'workloads' table)")
    if not report["workloads"]:
        raise InputError(f"{p}: its 'workloads' table is empty: no workload was evaluated, so there "
                         "is nothing to compare")
    for name, entry in report["workloads"].items():  # read with .get() below: tables, or a clear error
        key, value = f"workloads.{name}", entry
        if isinstance(entry, dict):
            key, value = f"{key}.methods", entry.get("methods", {})
        if not isinstance(value, dict):
            raise InputError(f"{p}: {key} must be a table, got {type(value).__name__}; not a "
                             "draftforge eval report")
        count = entry.get("num_prompts", 0)  # the pairing checks it against the per-prompt lists
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InputError(f"{p}: workloads.{name}.num_prompts must be a whole number of prompts, got "
                             f"{count!r}; the report is damaged: evaluate it again")
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
                + _rendering_differs(ra, rb)
            )
        pair = []
        for path, entry, method in ((pa, ea, a_method), (pb, eb, b_method)):
            totals = PromptTotals.from_summary(entry["methods"][method], f"{path}: {name}/{method}")
            if len(totals) != entry.get("num_prompts", len(totals)):  # the pairing is prompt by prompt
                raise InputError(
                    f"{path}: workload {name!r}, method {method!r}: prompt_rounds holds {len(totals)} "
                    f"prompts but the workload's num_prompts is {entry['num_prompts']}; the report "
                    "is damaged: evaluate it again"
                )
            if totals.rounds.sum() <= 0:  # its acceptance length, and any difference, is undefined
                raise InputError(
                    f"{path}: workload {name!r}, method {method!r} ran no verification round on any of "
                    f"its {len(totals)} prompts (prompt_rounds all 0: each ended at its first token, "
                    "max_new_tokens 1 or an end of sequence), so it has no acceptance length to "
                    "compare; evaluate it again with more --max-new-tokens"
                )
            pair.append(totals)
        if len(pair[0]) != len(pair[1]):  # neither records num_prompts (an older report)
            raise InputError(
                f"workload {name!r}: {a_method} of {pa} has per-prompt totals of {len(pair[0])} "
                f"prompts but {b_method} of {pb} of {len(pair[1])}, so they cannot be paired prompt "
                "by prompt; the report is damaged: evaluate it again"
            )
        out[name] = (pair[0], pair[1])
    return out


_UNRECORDED = object()


def _recorded(report: dict, key: str):
    """The value at a dotted ``key`` of report.json, or ``_UNRECORDED``."""
    value = report
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _UNRECORDED
        value = value[part]
    return value


# What sets each decoding setting when running draftforge eval (for the refusal's hint).
_SET_BY = {
    "target": "--target",
    "target_config.dtype": "--dtype",
    "target_config.backend": "the recipe's target.backend",
    "target_config.seed": "the recipe's target.seed",
    "target_config.shape": "the recipe's target.shape",
    "settings.temperature": "--temperature",
    "settings.top_k": "--top-k",
    "settings.top_p": "--top-p",
    "settings.draft_sampling": "--draft-sampling",
    "settings.max_new_tokens": "--max-new-tokens",
    "settings.seed": "--seed",
    "settings.verify": "--verify",
    "settings.threshold": "--threshold",
    "block_size": "a draft of the same block size (n-gram proposes block_size tokens a round)",
    "settings.ngram_max": "the same draftforge version (the n-gram order is fixed in it)",
    "settings.ngram_match": "--ngram-match",
}


def decoding_keys(ra: dict, a_method: str, rb: dict, b_method: str) -> list[str]:
    """The report.json keys (dotted) that must agree for ``a_method`` of ``ra`` and
    ``b_method`` of ``rb`` to be decoded alike; the drafts themselves may differ."""

    def either(key: str, test) -> bool:
        return any(test(v) for v in (_recorded(ra, key), _recorded(rb, key)) if v is not _UNRECORDED)

    def both(key: str, test) -> bool:
        # a setting in effect in one report only (a seed while the other decoded greedily, a
        # threshold under the other's full verification): the mode itself differs and is named;
        # its unused value in the other report is no difference to match (an unrecorded one is
        # taken to be in effect, and warned about)
        return either(key, test) and all(
            test(v) for v in (_recorded(ra, key), _recorded(rb, key)) if v is not _UNRECORDED)

    keys = ["target", "target_config.dtype", "target_config.backend",
            "settings.temperature", "settings.max_new_tokens"]  # fmt: skip
    if either("target", lambda v: v == "random"):  # a random target is its seed and shape
        keys += ["target_config.seed", "target_config.shape"]
    sampling = both("settings.temperature", lambda v: isinstance(v, (int, float)) and v > 0)
    if sampling:
        keys += ["settings.seed", "settings.top_k", "settings.top_p"]  # what draws the tokens
    methods = {a_method, b_method}
    if methods == {"dspark"}:  # the baselines always verify in full, the draft as told
        if sampling:
            keys.append("settings.draft_sampling")  # how the drafts propose (the baselines' are fixed)
        keys.append("settings.verify")
        if both("settings.verify", lambda v: v == "threshold"):
            keys.append("settings.threshold")
    if "ngram" in methods:  # n-gram proposes as many tokens as the report's draft block
        keys.append("block_size")
        if methods == {"ngram"}:
            keys += ["settings.ngram_max", "settings.ngram_match"]
    return keys


def check_same_decoding(
    a: tuple[Path, dict], a_method: str, b: tuple[Path, dict], b_method: str
) -> list[str]:
    """Refuse two reports decoded with different settings (:func:`decoding_keys`).

    A setting that a report does not record (an older draftforge eval) cannot be checked:
    it is named in a warning on stderr and the comparison goes on. Returns notes for the
    output (the drafts' block sizes, when they differ)."""
    (pa, ra), (pb, rb) = a, b
    if ra is rb or pa.resolve() == pb.resolve():
        return []  # one run: decoded alike by construction
    differ, unrecorded = [], {pa: [], pb: []}
    for key in decoding_keys(ra, a_method, rb, b_method):
        va, vb = _recorded(ra, key), _recorded(rb, key)
        for path, value in ((pa, va), (pb, vb)):
            if value is _UNRECORDED:
                unrecorded[path].append(key)
        if _UNRECORDED not in (va, vb) and va != vb:
            differ.append(key)
    if differ:
        values = "; ".join(
            f"{key} is {_recorded(ra, key)!r} in A, {_recorded(rb, key)!r} in B" for key in differ
        )
        fixes = ", ".join(dict.fromkeys(_SET_BY[key] for key in differ))
        raise InputError(
            f"A ({pa}) and B ({pb}) were not decoded with the same settings, so a paired "
            f"difference of their acceptance lengths would not compare like with like: {values}; "
            f"evaluate one of them again to match the other ({fixes})"
        )
    for path, keys in unrecorded.items():
        if keys:
            print(
                f"draftforge eval compare: warning: {path} does not record {', '.join(keys)} "
                "(an older draftforge eval wrote it), so whether both reports used the same "
                "is not checked",
                file=sys.stderr,
            )
    block_a, block_b = _recorded(ra, "block_size"), _recorded(rb, "block_size")
    if a_method == b_method == "dspark" and _UNRECORDED not in (block_a, block_b) and block_a != block_b:
        return [f"the drafts' block sizes differ (A {block_a}, B {block_b}): part of what is compared"]
    return []


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.draws < 1:
        parser.error(f"--draws must be at least 1, got {args.draws}")
    if not 0 < args.level < 1:
        parser.error(f"--level must lie strictly between 0 and 1, got {args.level}")
    # else an interval end is the extreme draw, or none: at the nominal level first, before the
    # reports are read; at the level the intervals are read at once their prompts are known
    least = least_draws(args.level)
    if args.draws < least:
        parser.error(f"--draws {args.draws} is too few for a {args.level:g} interval: each of its "
                     f"tails needs a draw, so at least {least}")
    a = load_report(args.a)
    b = load_report(args.b) if args.b else a
    b_method = args.b_method or ("dspark" if args.b else "ngram")
    if b_method == args.a_method and (b is a or a[0].resolve() == b[0].resolve()):
        raise InputError(
            f"comparing {args.a_method} of {a[0]} with itself (a difference of zero by construction): "
            "give another report as B or another --b-method"
        )
    pairs = paired_totals(a, args.a_method, b, b_method)
    notes = check_same_decoding(a, args.a_method, b, b_method)
    largest = max(pairs, key=lambda name: len(pairs[name][0]))
    prompts = len(pairs[largest][0])
    # the fewest prompts with a round read the widest level; below MIN_PROMPTS no verdict is
    # given and the expanded level would ask millions of draws (7 million at 3 prompts), so the
    # nominal check above is all those get
    fewest = min(t.with_rounds() for pair in pairs.values() for t in pair)
    least = least_draws(args.level, fewest) if fewest >= MIN_PROMPTS else least
    most = max(MAX_RESAMPLED // prompts, DRAWS)  # the draws memory allows
    # the default draws always run, as draftforge eval ran them for this very report
    if args.draws > DRAWS and args.draws * prompts > MAX_RESAMPLED:
        level = f"; --level {args.level:g} needs {least:,}: lower it" if least > most else ""
        raise InputError(
            f"--draws {args.draws:,}: each draw resamples the {prompts} prompts of workload "
            f"{largest!r}, {args.draws * prompts:,} prompt indices held in memory at once (about "
            f"{16 * args.draws * prompts / 1e9:.0f} GB); give at most {most:,} draws (the default "
            f"is {DRAWS:,}){level}"
        )
    if args.draws < least:
        raise InputError(
            f"--draws {args.draws:,} is too few for a {args.level:g} interval at {fewest} prompts "
            f"(workload {min(pairs, key=lambda n: min(t.with_rounds() for t in pairs[n]))!r}): it is "
            f"read at the expanded level {expanded_level(args.level, fewest):.6g} (each tail "
            f"{expanded_tail(args.level, fewest):.3g} of the draws), and each of its tails needs a "
            f"draw, so at least {least:,}" + ("" if least <= most else
                                              f", more than the {most:,} memory allows: lower --level")
        )
    kw = {"draws": args.draws, "level": args.level, "seed": args.seed}
    print(
        f"eval compare: {a[0]} ({args.a_method}) minus {b[0]} ({b_method}), paired on the same "
        f"prompts; {args.level:.0%} bootstrap intervals over prompts, {args.draws} draws, expanded "
        "percentile (widened for few prompts)"
    )
    for note in notes:
        print(f"note: {note}")
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
    for note in _dropped_notes(diffs):
        print(f"note: {note}")
    print(
        f"diff_macro={diff.value:.4f} low={diff.low:.4f} high={diff.high:.4f} "
        f"verdict={diff.verdict().replace(' ', '_')}"
    )
    return 0


def _dropped_notes(diffs: dict[str, Interval]) -> list[str]:
    """One note per row whose interval left out draws without any verification round."""
    return [
        f"{name}: {diff.dropped:,} of {diff.draws:,} draws resampled only prompts on which A or B "
        "ran no verification round; they have no difference and are left out of its interval"
        for name, diff in diffs.items()
        if diff.dropped
    ]


def _rendering_differs(ra: dict, rb: dict) -> str:
    """Why two reports' prompts may differ where they rendered them otherwise (``prompt_rendering``:
    thinking mode and template, which eval takes from each draft's training recipe without
    --recipe); empty where they agree or a report does not say."""
    a, b = ra.get("prompt_rendering"), rb.get("prompt_rendering")
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return ""
    differ = [f"{key} {a.get(key)!r} against {b.get(key)!r}" for key in ("enable_thinking", "chat_template")
              if a.get(key) != b.get(key)]
    return (f"; they rendered the workloads otherwise ({', '.join(differ)}: without --recipe each draft is "
            "evaluated as its training recipe records; pass the same --recipe to both)") if differ else ""
