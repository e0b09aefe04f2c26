"""The demo's results: the table of acceptance lengths and speeds, the lead of DSpark with
its intervals, and demo.md (command, date, machine, what the numbers mean)."""

from __future__ import annotations

import json
import math
import platform
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from draftforge.cores import usable_cores
from draftforge.eval.demo_runs import DFLASH_OVERRIDES, DemoPaths
from draftforge.eval.demo_state import mtime
from draftforge.precision import cpu_bf16_flags


def _fmt(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}"


def _mean(values: Sequence[float | None]) -> float:
    clean = [v for v in values if v is not None and math.isfinite(v)]
    return sum(clean) / len(clean) if clean and len(clean) == len(values) else math.nan


def table_rows(dspark_report: dict, dflash_report: dict) -> list[dict]:
    """One row per workload of the DSpark report, plus the macro mean (unweighted over workloads)."""
    rows = []
    for name, entry in dspark_report["workloads"].items():
        methods = entry["methods"]
        dflash = dflash_report["workloads"].get(name, {}).get("methods", {}).get("dspark", {})
        estimate = entry.get("train_time_estimate") or {}
        rows.append({
            "workload": name,
            "dspark": methods.get("dspark", {}).get("acceptance_length"),
            "dflash": dflash.get("acceptance_length"),
            "ngram": methods.get("ngram", {}).get("acceptance_length"),
            "none_tps": methods.get("none", {}).get("tokens_per_s"),
            "dspark_tps": methods.get("dspark", {}).get("tokens_per_s"),
            "tau": estimate.get("tau"),
        })  # fmt: skip
    keys = ("dspark", "dflash", "ngram", "none_tps", "dspark_tps", "tau")
    rows.append({"workload": "macro mean", **{k: _mean([r[k] for r in rows]) for k in keys}})
    return rows


def markdown_table(rows: Sequence[dict]) -> str:
    """The demo's table: acceptance lengths, speeds and the train-time estimate per workload."""
    lines = [
        "| workload | DSpark AL | DFlash AL | n-gram AL | no-draft tok/s | DSpark tok/s | train-time tau |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        speedup = (
            f" ({r['dspark_tps'] / r['none_tps']:.2f}x)"
            if r["none_tps"] and r["dspark_tps"] and math.isfinite(r["none_tps"] * r["dspark_tps"])
            else ""
        )
        name = f"**{r['workload']}**" if r["workload"] == "macro mean" else r["workload"]
        lines.append(
            f"| {name} | {_fmt(r['dspark'])} | {_fmt(r['dflash'])} | {_fmt(r['ngram'])} | "
            f"{_fmt(r['none_tps'], 1)} | {_fmt(r['dspark_tps'], 1)}{speedup} | {_fmt(r['tau'])} |"
        )
    return "\n".join(lines)


def lead_table(dspark: tuple[Path, dict], dflash: tuple[Path, dict]) -> str:
    """DSpark minus n-gram and minus DFlash, per workload and macro, with paired bootstrap
    intervals over the prompts (:mod:`draftforge.eval.uncertainty`). A comparison that
    ``draftforge eval compare`` would refuse (other prompts, other decoding settings) gets a
    line saying why instead of its row."""
    from draftforge.errors import InputError
    from draftforge.eval.compare import check_same_decoding, paired_totals
    from draftforge.eval.uncertainty import LEVEL, by_workload, interval_text

    comparisons, refused = {}, []
    for label, other, method in (("DSpark - n-gram", dspark, "ngram"), ("DSpark - DFlash", dflash, "dspark")):
        try:
            pairs = paired_totals(dspark, "dspark", other, method)
            check_same_decoding(dspark, "dspark", other, method)
        except InputError as err:
            refused.append(f"(No intervals for {label}: {err}.)")
        else:
            comparisons[label] = pairs
    if not comparisons:
        return "\n\n".join(refused)
    names = list(next(iter(comparisons.values())))
    lines = [
        f"Is DSpark ahead? Differences in AL, paired on the same prompts, with {LEVEL:.0%} "
        "bootstrap intervals over the prompts (`draftforge eval compare`):",
        "",
        "| comparison | " + " | ".join(names) + " | macro mean | verdict (macro) |",
        "| --- |" + " ---: |" * (len(names) + 1) + " --- |",
    ]
    for label, pairs in comparisons.items():
        cells = by_workload(pairs)  # the workloads, then "macro"
        text = " | ".join(interval_text(c.value, c.low, c.high, signed=True) for c in cells.values())
        lines.append(f"| {label} | {text} | {cells['macro'].verdict()} |")
    return "\n".join(lines + [line for why in refused for line in ("", why)])


def recorded_devices(*reports: dict) -> list[str]:
    """The devices the evaluations ran on, as their report.json files record them."""
    devices = []
    for report in reports:
        devices += report.get("target_devices") or ([report["device"]] if report.get("device") else [])
    return list(dict.fromkeys(devices))


def host_description() -> str:
    """This machine: its usable cores, CPU model and native bf16 extensions, and its system
    (``draftforge eval`` records it in report.json)."""
    model = platform.processor() or platform.machine()
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""  # not Linux: no model name, no flags
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    flags = cpu_bf16_flags(cpuinfo)
    bf16 = f"native bf16: {', '.join(flags)}" if flags else "no native bf16"
    return f"{usable_cores()} cores ({model}, {bf16}), {platform.system()}"


def _machine(devices: Sequence[str], reports: Sequence[dict] = ()) -> str:
    """The machine the evaluations recorded (this one where they recorded none: reports written
    before they did), with the devices they ran on (``draftforge eval --device auto`` takes a
    GPU where one is visible)."""
    hosts = list(dict.fromkeys(r["host"] for r in reports if r.get("host")))
    if not hosts:
        host = host_description() + (" (this machine: the evaluations recorded none)" if reports else "")
    else:
        host = "; ".join(hosts)
    if not devices:
        evaluated = "the evaluations' device not recorded"
    elif all(d == "cpu" for d in devices):
        evaluated = "evaluated on the CPU, no GPU used"
    else:
        evaluated = f"evaluated on {', '.join(devices)}"
    return f"{host}, {evaluated}"


def code_line(reports: Sequence[dict]) -> str:
    """The draftforge revision the evaluations ran at, and a warning where it is not this
    checkout's: a rerun that finds every stage done prints the table it measured then."""
    from draftforge.train.metrics import git_revision

    now = git_revision()  # None for an installed copy, as draftforge eval then records
    unrecorded = object()  # a report written before reports recorded the revision
    recorded = dict.fromkeys(r.get("draftforge_revision", unrecorded) for r in reports)
    other = ["not recorded" if r is unrecorded else r or "an installed copy" for r in recorded if r != now]
    line = f"Code: draftforge {now or 'installed copy (no git revision)'}"
    if other:
        line += (f"; the evaluations ran at {', '.join(other)}: not this code's figures "
                 "(`draftforge demo --force --skip-train` measures them again)")
    return line + "."


SAME_SITTING_S = 3600  # evaluations finished closer together than this get one date


def measured_when(dspark_finished: float, dflash_finished: float) -> str:
    """When the two evaluations finished (POSIX times): the later one's date, or both when
    an interrupted demo finished them in different sittings."""
    def utc(stamp: float) -> str:
        return datetime.fromtimestamp(stamp, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    if abs(dspark_finished - dflash_finished) < SAME_SITTING_S:
        return utc(max(dspark_finished, dflash_finished))
    return f"{utc(dspark_finished)} (DSpark evaluation), {utc(dflash_finished)} (DFlash evaluation)"


def counted(n: int, noun: str) -> str:
    """``1 prompt``, ``8 prompts``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _prompts_text(asked: int, prompts: dict[str, int] | None) -> str:
    """How many prompts the evaluations ran: ``--num-prompts`` takes all of a workload that
    has fewer (MT-Bench has 80)."""
    if not prompts or all(n == asked for n in prompts.values()):
        return f"{counted(asked, 'prompt')} per workload"
    each = ", ".join(f"{name} {n}" for name, n in prompts.items())
    return f"prompts per workload: {each} (all of a workload with fewer than the {asked} asked)"


def _training_tau(run_dir: Path) -> float | None:
    summary = run_dir / "summary.json"
    if not summary.is_file():
        return None
    return json.loads(summary.read_text()).get("tau")


def demo_markdown(
    table: str,
    *,
    command: str,
    cfg,
    paths: DemoPaths,
    num_prompts: int,
    max_new_tokens: int,
    block_size: int,
    trained: dict[str, int] | None = None,
    stopped: dict[str, str] | None = None,
    skip_train: bool = False,
    devices: Sequence[str] = (),
    prompts: dict[str, int] | None = None,
    reports: Sequence[dict] = (),
) -> str:
    """demo.md: the table with the command, date, machine and what the numbers mean;
    ``prompts``: the prompts each workload was evaluated on (report.json), fewer than
    ``num_prompts`` where a workload has fewer;
    ``trained``: the steps of the checkpoint each draft was evaluated at, short of the
    recipe's where ``stopped`` names the draft's stop reason (``data_exhausted``: its
    training ran out of data) or ``skip_train`` evaluated an unfinished run; ``devices``:
    where the evaluations ran (:func:`recorded_devices`); ``reports``: the two evaluations'
    report.json, for the machine and the code revision they recorded."""
    steps = cfg.train.steps
    budget = f"Both drafts: {steps} steps of the recipe"
    if trained and any(n != steps for n in trained.values()):
        why = []
        for what, n in trained.items():
            if n == steps:
                continue
            if (stopped or {}).get(what) == "data_exhausted":
                why.append(f"{what} stopped at step {n}: the data ran out")
            else:
                why.append("--skip-train: an unfinished run" if skip_train else f"{what}: an unfinished run")
        budget = ("Drafts evaluated at " + ", ".join(f"{what} step {n}" for what, n in trained.items())
                  + f" of the recipe's {steps} ({'; '.join(dict.fromkeys(why))}; not the full budget)")
    verified = "every drafted token verified (`--verify full`, for both drafts: DFlash has no confidence head)"
    if cfg.eval.verify == "threshold":
        verified += "; the recipe's `eval.verify: threshold` is not applied"
    taus = (_training_tau(paths.run_dir), _training_tau(paths.dflash_dir))
    # when the evaluations finished (a rerun that skips every stage keeps those dates)
    measured = measured_when(mtime(paths.eval_dir / "report.json"),
                             mtime(paths.dflash_eval_dir / "report.json"))
    return "\n".join(
        [
            f"# draftforge demo: {cfg.name}",
            "",
            f"Command: `{command}`  ",
            f"Measured: {measured}; machine: {_machine(devices, reports)}.  ",
            code_line(reports),
            "",
            f"Target `{cfg.target.model}` (evaluated in float32), greedy decoding (checked lossless "
            f"against plain decoding), {verified}, {_prompts_text(num_prompts, prompts)}, up to {max_new_tokens} new "
            f"tokens, blocks of {block_size}. {budget} in "
            f"{cfg.train.dtype} (target features in {cfg.target.dtype}); "
            f"DFlash = the same recipe with `{' '.join(DFLASH_OVERRIDES)}`"
            + (
                "; DSpark's Markov head started as the training answers' bigram table "
                "(`train.markov_init=bigram`)."
                if cfg.train.markov_init == "bigram"
                else "."
            ),
            "",
            table,
            "",
            f"AL: mean acceptance length per verification round (accepted drafts + 1 bonus token; "
            f"no draft = 1.00, at most {block_size + 1}). Tokens/s are measured in one process on the "
            "same prompts (the speed-up is DSpark over no draft; the macro row's, the ratio of its two "
            "mean speeds). Train-time tau: the training "
            "metric on the evaluation prompts (see the eval report). At the end of training, tau on "
            f"the training data was {_fmt(taus[0])} (DSpark) and {_fmt(taus[1])} (DFlash).",
            "",
            f"Reports: `{paths.eval_dir}/report.md` (DSpark and baselines), "
            f"`{paths.dflash_eval_dir}/report.md` (DFlash); export: `{paths.export_dir}`.",
            "",
        ]
    )
