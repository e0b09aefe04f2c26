"""The evaluation report: a markdown table, the JSON behind it and PNG plots (matplotlib, Agg)."""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

from draftforge.eval.harness import METHODS, WorkloadResult, macro
from draftforge.eval.uncertainty import MIN_PROMPTS, PromptTotals, interval_text, report_uncertainty
from draftforge.files import write_atomic, write_atomic_all

ESTIMATE_NOTE = (
    "tau (train-time estimate) is the training metric 1 + sum_k prod_{i<=k} c*_i computed through the "
    "training objective, teacher-forced on the target's own outputs for these prompts; c* is the "
    "acceptance probability of speculative sampling at temperature 1. tau_greedy replaces c* by the "
    "greedy match indicator. Both average over up to 64 randomly drawn response positions a prompt as anchors, while decoding "
    "anchors only where the previous round stopped (often right after a hard token): expect measured AL "
    "at or below the estimate of the rule this run verified with (tau_greedy under greedy decoding, "
    "tau_sampled below when sampling; every estimate verifies the whole block, so under --verify "
    "threshold, whose cut can only end a round sooner, measured AL lies further below it). c* is "
    "not the greedy acceptance rule: greedy verification accepts a draft token whenever it is the target's "
    "most likely one, which can be more or less often than c*, so under greedy decoding tau can lie on "
    "either side of the measured AL. "
    "When decoding samples, tau_sampled replaces c* by the acceptance probability of the rule this run "
    "verified with, at its temperature, top-k and top-p (greedy drafts: the target's probability of the "
    "draft's most likely token; drawn drafts: sum_x min(p_t(x), p_d(x))), still teacher-forced on the "
    "target's sampled outputs."
)


AL_NOTE = (
    "Acceptance length: the accepted draft tokens plus the bonus token of a verification round (a "
    "round that accepts the end of sequence counts up to it, without the bonus), mean over the "
    "workload's verification rounds, a round with no draft included (n-gram lookup that finds no "
    "match: AL 1; vLLM's mean acceptance length leaves such steps out): pooled over its prompts, so a prompt that runs more rounds "
    "weighs more (not the mean of per-prompt means). A prompt's last round may reach past "
    "max_new_tokens: it counts its whole accepted run and the output is cut after it (at most one "
    "such round a prompt), so a prompt's summed acceptance lengths can exceed its new tokens. "
    "Tokens verified / round: the tokens the target ran per round, the anchor included. Tokens/s: "
    "the new tokens (the prefill's first one included, cut at max_new_tokens) over the decoding's "
    "wall time (the prefill included, the untimed warm-up not), summed over the workload's prompts; "
    "speed-up: over the no-draft method's tokens/s. The macro figures are the unweighted mean over "
    "workloads."
)


def _fmt(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def decoding_line(settings: dict, near_ties: int = 0) -> str:
    """How the run decoded, in words, from report.json's ``settings``; ``near_ties``: the
    greedy outputs whose lossless check stopped at a numerical near-tie. A threshold
    verification and the n-gram baseline's match rule follow as sentences of their own."""
    return " ".join([_sampling_sentence(settings, near_ties)] + _method_sentences(settings))


def _method_sentences(settings: dict) -> list[str]:
    sentences = []
    if settings.get("verify") == "threshold":
        sentences.append(
            f"The draft's blocks are cut at a static confidence threshold of {settings.get('threshold')}: "
            "only the slots before the first whose confidence is below it are verified (SGLang "
            "serves no static threshold, so these figures do not predict its acceptance)."
        )
    if "ngram" in settings.get("baselines", ()) and "ngram_match" in settings:
        rule = {"latest": "the most recent", "earliest": "the earliest (vLLM's rule)"}[settings["ngram_match"]]
        sentences.append(
            f"n-gram: the longest suffix n-gram (up to {settings.get('ngram_max', 3)}) first, "
            f"copied from {rule} earlier match."
        )
    return sentences


def _sampling_sentence(settings: dict, near_ties: int) -> str:
    if not settings.get("temperature"):
        if not near_ties:
            return "Decoding: greedy, every output checked identical to plain greedy decoding."
        tolerance = settings.get("tie_tolerance")
        below = f" (top-2 logit margin below {tolerance})" if tolerance is not None else ""
        return (f"Decoding: greedy, every output checked identical to plain greedy decoding up to "
                f"the end, except {near_ties} that diverged at a numerical near-tie{below} and are "
                "identical up to it (not checked after it; report.json: lossless_near_ties).")
    cuts = ""
    if settings.get("top_k"):
        cuts += f", top-k {settings['top_k']}"
    if settings.get("top_p", 1.0) < 1.0:
        cuts += f", top-p {settings['top_p']}"
    drafting = {
        "greedy": "the draft proposes its most likely tokens, each accepted with the target's probability of it",
        "sample": "the draft draws its tokens from its own distribution, each accepted with min(1, p_t/p_d)",
    }[settings["draft_sampling"]]
    return f"Decoding: sampled at temperature {settings['temperature']}{cuts}, seed {settings.get('seed', 0)}; {drafting}."


def draft_kind(cfg) -> str:
    """What the ``dspark`` method's draft is, in words, from its DSparkConfig: the DFlash
    ablation (no Markov head) is evaluated under the same method key."""
    if cfg.markov_rank > 0:
        kind = f"a DSpark draft (block {cfg.block_size}, {cfg.markov_head_type} Markov head of rank {cfg.markov_rank}"
    else:
        kind = f"a draft without a Markov head (DFlash-style; block {cfg.block_size}"
    return kind + (", confidence head)" if cfg.enable_confidence_head else ", no confidence head)")


def markdown_table(
    results: Sequence[WorkloadResult], *, block_size: int, command: str | None = None,
    intervals: dict | None = None, settings: dict | None = None, draft: str | None = None,
    calibration: dict | None = None, num_prompts: int | None = None,
) -> str:
    """Acceptance length, verification width and speed per workload and method, plus positions
    and the bootstrap ``intervals`` (:func:`uncertainty`, computed here when not given);
    ``draft``: :func:`draft_kind` of the draft the ``dspark`` rows measured; ``calibration``:
    report.json's (``--calibrate``), whose pooled ECE before and after it states;
    ``num_prompts``: the prompts asked per workload (None: all), beside those measured."""
    lines = []
    if command:
        lines += [f"Command: `{command}`", ""]
    if settings is not None:
        lines += [decoding_line(settings, sum(r.near_ties for r in results)), ""]
    if draft is not None:
        lines += [f"The `dspark` rows measure the draft under test: {draft}.", ""]
    fewer = num_prompts is not None and any(r.num_prompts < num_prompts for r in results)
    lines += [f"Prompts per workload: {', '.join(f'{r.name} {r.num_prompts}' for r in results)}"
              + (f" (all of a workload with fewer than the {num_prompts} asked)." if fewer else "."), ""]
    lines += [
        "| workload | method | acceptance length | tokens verified / round | tokens/s | speed-up | wall s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        base = r.methods.get("none", {}).get("tokens_per_s")
        for method in METHODS:
            m = r.methods.get(method)
            if m is None:
                continue
            # no no-draft baseline, or a speed not measured (no time: NaN, truthy)
            ratio = m["tokens_per_s"] / base if base else math.nan
            speedup = f"{ratio:.2f}x" if math.isfinite(ratio) else "-"
            lines.append(
                f"| {r.name} | {method} | {_fmt(m['acceptance_length'])} | "
                f"{_fmt(m['tokens_verified_per_round'])} | {_fmt(m['tokens_per_s'], 1)} | "
                f"{speedup} | {_fmt(m['wall_s'], 1)} |"
            )
    macro_row = " / ".join(f"{m} {_fmt(macro(results, m))}" for m in METHODS if any(m in r.methods for r in results))
    lines += ["", AL_NOTE, "", f"Macro acceptance length (unweighted mean over workloads): {macro_row}", ""]
    header = " | ".join(f"k={k}" for k in range(block_size))
    lines += [
        "Per-position conditional acceptance (accepted / reached), the draft under test:",
        "",
        f"| workload | {header} |",
        "| --- |" + " ---: |" * block_size,
    ]
    for r in results:
        m = r.methods.get("dspark")
        if m:
            lines.append(f"| {r.name} | " + " | ".join(_fmt(v) for v in m["position_acceptance"]) + " |")
    lines += [""]
    if any(r.estimate for r in results):
        lines += estimate_lines(results)
    else:  # --no-estimate: no table of dashes, no note on what it would have held
        off = " (`--no-estimate`)" if (settings or {}).get("estimate") is False else ""
        lines += [f"No train-time estimate{off}.", ""]
    lines += calibration_lines(calibration)
    lines += lookup_lines(results)
    lines += uncertainty_lines(uncertainty(results) if intervals is None else intervals)
    return "\n".join(lines)


def estimate_lines(results: Sequence[WorkloadResult]) -> list[str]:
    """The train-time estimate beside the measured acceptance length, and what it means."""
    lines = ["Train-time estimate beside the measured acceptance length (the draft under test):", ""]
    sampled = any("tau_sampled" in (r.estimate or {}) for r in results)
    lines += ["| workload | measured AL | tau (c*) | tau_greedy |" + (" tau_sampled |" if sampled else ""),
              "| --- | ---: | ---: | ---: |" + (" ---: |" if sampled else "")]  # fmt: skip
    for r in results:
        est = r.estimate or {}
        measured = r.methods.get("dspark", {}).get("acceptance_length")
        cells = [measured, est.get("tau"), est.get("tau_greedy")] + ([est.get("tau_sampled")] if sampled else [])
        lines.append(f"| {r.name} | " + " | ".join(_fmt(v) for v in cells) + " |")
    return [*lines, "", ESTIMATE_NOTE, ""]


def calibration_lines(calibration: dict | None) -> list[str]:
    """The confidence calibration (``--calibrate``; report.json's ``calibration``): where the
    temperatures went and the pooled ECE before and after them on the held-out samples."""
    if not calibration:
        return []
    temperatures = ", ".join(f"{t:.3f}" for t in calibration["temperatures"])
    survival = calibration.get("rule") == "survival"
    held_out = (calibration.get("held_out_samples") or [0])[0] if survival else sum(calibration.get("held_out_samples") or [])
    before, after = calibration.get("pooled_ece_before"), calibration.get("pooled_ece_after")
    if held_out and _fmt(before, 4) != "-":
        what = (f"survival ECE (SGLang's: 15 bins) pooled over every position of the {held_out} held-out rounds"
                if survival else f"ECE pooled over the {held_out} held-out samples")
        ece = f"{what} (every second prompt of each workload): {_fmt(before, 4)} before, {_fmt(after, 4)} after"
    elif survival:
        ece = "no ECE: the held-out prompts (every second of each workload) gave no round with every draft's outcome known"
    else:
        ece = "no ECE: the held-out prompts (every second of each workload) verified no draft position"
    failed = calibration.get("write_error")  # the fit is reported; its file could not be written
    where = (f"fitted, but `{calibration.get('path')}` could not be written ({failed})" if failed
             else f"written to `{calibration.get('path')}`")
    rule = (" by SGLang's rule (sglang.benchmark.dspark_sts_fit: each position's temperature from "
            "a grid of 41, 0.1 to 10, minimising the survival ECE)" if survival else "")
    return [f"Confidence calibration {where}{rule}: temperatures per "
            f"position [{temperatures}]; {ece}.", *_calibration_positions(calibration), ""]


def _calibration_positions(calibration: dict) -> list[str]:
    """Per position, the held-out ECE before and after ("n/a" where no held-out sample reached
    it: not measured, not 0), and which temperatures are a bound of the fit's search, not a
    fitted value (:func:`draftforge.eval.calibration.bound_hit`), or no fit at all (fewer than
    ``MIN_FIT_SAMPLES`` fitting samples: T = 1 kept, which read as a fitted 1.000). Nothing for
    a report.json written before these were recorded."""
    from draftforge.eval.calibration import (
        MAX_TEMPERATURE,
        MIN_FIT_SAMPLES,
        MIN_TEMPERATURE,
        SURVIVAL_GRID,
    )

    survival = calibration.get("rule") == "survival"
    unit = "round" if survival else "sample"
    lines = []
    before, after = calibration.get("ece_before"), calibration.get("ece_after")
    if before is not None and after is not None:
        cells = [f"{k}: n/a (no held-out {unit})" if b is None or a is None else f"{k}: {b:.4f} -> {a:.4f}"
                 for k, (b, a) in enumerate(zip(before, after, strict=True))]
        what = "Survival ECE per position on the held-out rounds" if survival else "ECE per position on the held-out samples"
        lines.append(f"{what}, before -> after: {'; '.join(cells)}.")
    if survival:
        bounds = {"upper": f"the grid's upper end {SURVIVAL_GRID[-1]:g}", "lower": f"the grid's lower end {SURVIVAL_GRID[0]:g}"}
        why = "the survival ECE was lowest there, as SGLang's fitter would find it; a wider grid might go further"
    else:
        bounds = {"upper": f"the search's upper bound {MAX_TEMPERATURE:g}",
                  "lower": f"the search's lower bound {MIN_TEMPERATURE:g}"}
        why = ("the log loss still fell beyond it (at the upper bound the confidence there predicts acceptance "
               "worse than a constant, e.g. nearly every draft rejected while the head says accept); the file "
               "keeps the bound")
    hit = [f"position {k} ({bounds[b]})" for k, b in enumerate(calibration.get("temperature_at_bound") or ())
           if b in bounds]
    if hit:
        lines.append(f"Temperature at a bound, not a fitted value: {', '.join(hit)}: {why}.")
    unfitted = [f"position {k} ({n} fitting {unit}{'' if n == 1 else 's'})"
                for k, n in enumerate(calibration.get("fit_samples") or ()) if n < MIN_FIT_SAMPLES]
    if unfitted:
        lines.append(f"Temperature not fitted, kept at 1 (fewer than {MIN_FIT_SAMPLES} fitting {unit}s): "
                     f"{', '.join(unfitted)}.")
    return lines


LOOKUP_NOTE = (
    "The same anchors, split by whether n-gram lookup (the ngram baseline) has a proposal there: "
    "the teacher-forced accepted run (1 + tokens accepted) of the draft and of the lookup. A draft "
    "that copies from its context scores higher where lookup matches than elsewhere."
)


def lookup_lines(results: Sequence[WorkloadResult]) -> list[str]:
    """Where n-gram lookup wins: the estimate's anchors split by whether lookup proposes."""
    rows = [(r.name, r.estimate) for r in results if r.estimate and "lookup_share" in r.estimate]
    if not rows:
        return []
    lines = [
        # the draft under test, as the tables above say: "DSpark" was printed over the DFlash
        # ablation's figures too (the demo's DFlash report)
        "Where n-gram lookup proposes (the draft under test):",
        "",
        "| workload | anchors with a lookup match | draft run there | n-gram run there | draft run elsewhere |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, est in rows:
        share = est["lookup_share"]
        share_cell = "-" if math.isnan(share) else f"{100 * share:.0f} %"
        lines.append(
            f"| {name} | {share_cell} | {_fmt(est['tau_greedy_at_lookup'])} | "
            f"{_fmt(est['ngram_run_at_lookup'])} | {_fmt(est['tau_greedy_elsewhere'])} |"
        )
    return [*lines, "", LOOKUP_NOTE, ""]


def uncertainty(results: Sequence[WorkloadResult]) -> dict:
    """Bootstrap intervals over prompts (see :mod:`draftforge.eval.uncertainty`)."""
    return report_uncertainty({
        r.name: {m: PromptTotals.from_summary(r.methods[m], f"{r.name}/{m}") for m in METHODS
                 if m in r.methods}
        for r in results
    })  # fmt: skip


def _bounds(iv: dict) -> dict:
    return {k: iv[k] for k in ("value", "low", "high")}


def uncertainty_lines(u: dict) -> list[str]:
    """The report's section on how far its prompts can be trusted."""
    level = f"{u['level']:.0%}"
    lines = [
        f"How much these prompts can tell apart ({level} bootstrap intervals over prompts, "
        f"{u['draws']} draws, expanded percentile: widened for few prompts; the macro mean "
        "resamples each workload's prompts on its own):",
        "",
    ]
    per_method = u["acceptance_length"]
    names = [n for n in next(iter(per_method.values()), {}) if n != "macro"] + ["macro"]
    lines += ["| workload | " + " | ".join(f"{m} AL" for m in per_method) + " |",
              "| --- |" + " ---: |" * len(per_method)]  # fmt: skip
    for n in names:
        lines.append(f"| {n} | " + " | ".join(interval_text(**_bounds(per_method[m][n])) for m in per_method) + " |")
    few = {n: min(per_method[m][n].get("prompts", MIN_PROMPTS) for m in per_method) for n in names if n != "macro"}
    few = {n: count for n, count in few.items() if count < MIN_PROMPTS}
    if few:  # the paired tables say "too few prompts"; this one has no verdict column to say it
        lines += ["", "Too few prompts with a verification round to show their spread (fewer than "
                  f"{MIN_PROMPTS}; one gives a zero-width interval), so these intervals are narrower than "
                  "the choice of prompts allows, and the macro interval counts no spread for them: "
                  + ", ".join(f"{n} ({count})" for n, count in few.items()) + "."]
    for pair, per in u["paired"].items():
        a, b = pair.split("-", 1)
        lines += ["", f"{a} minus {b}, paired on the same prompts:", "",
                  "| workload | difference | verdict |", "| --- | ---: | --- |"]  # fmt: skip
        for n in names:
            lines.append(f"| {n} | {interval_text(**_bounds(per[n]), signed=True)} | {per[n]['verdict']} |")
    dropped = [(f"{m} AL", n, per_method[m][n]) for m in per_method for n in names]
    dropped += [(pair, n, per[n]) for pair, per in u["paired"].items() for n in names]
    notes = [f"{what}, {n}: {iv['dropped']:,} of {iv['draws']:,} draws" for what, n, iv in dropped
             if iv.get("dropped")]  # fmt: skip
    if notes:  # reports written before the count have no "dropped": nothing to say
        lines += ["", "Draws that resampled only prompts without a verification round have no "
                  "acceptance length and are left out of these intervals: " + "; ".join(notes) + "."]  # fmt: skip
    return [*lines, ""]


def report_dict(results: Sequence[WorkloadResult], meta: dict, *, intervals: dict | None = None) -> dict:
    """The JSON report: settings, per-workload metrics, macro numbers, the bootstrap
    ``intervals`` (computed here when not given) and calibration if any.

    ``meta`` comes first: the command, ``target`` and ``target_config``, the decoding
    ``settings`` and ``block_size``, which ``draftforge eval compare`` checks to agree
    before it pairs two reports."""
    return {
        **meta,
        "workloads": {
            r.name: {
                "num_prompts": r.num_prompts,
                "methods": r.methods,
                "train_time_estimate": r.estimate,
                "lossless_near_ties": r.near_ties,
                "prompt_digest": r.prompt_digest,
            }
            for r in results
        },
        "macro_acceptance_length": {
            m: macro(results, m) for m in METHODS if any(m in r.methods for r in results)
        },
        "uncertainty": uncertainty(results) if intervals is None else intervals,
        # what the estimate means, where one was computed (not with --no-estimate)
        **({"estimate_note": ESTIMATE_NOTE} if any(r.estimate for r in results) else {}),
    }


def plot(results: Sequence[WorkloadResult], out_dir: Path, *, block_size: int, save=None) -> list[Path]:
    """acceptance_length.png (bars per workload and method) and position_acceptance.png (lines),
    each given to ``save(figure, path)`` (by default written there atomically)."""
    save = save or _save
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
    methods = [m for m in METHODS if any(m in r.methods for r in results)]
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        values = [r.methods.get(method, {}).get("acceptance_length", float("nan")) for r in results]
        ax.bar([x + i * width for x in range(len(results))], values, width, label=method)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(results))])
    ax.set_xticklabels([r.name for r in results])
    ax.set_ylabel("acceptance length (mean per round)")
    ax.set_title("Acceptance length: accepted drafts + 1 bonus token, mean per verification round",
                 fontsize=9)
    ax.axhline(block_size + 1, color="grey", linestyle=":", linewidth=1)
    # the dotted line is the ceiling, said on it (not in the legend, which names the methods)
    ax.text(-0.45, block_size + 1, f"at most block size + 1 = {block_size + 1}", color="grey",
            fontsize=7, va="bottom")
    # from 0 and around every workload's bars, measured or not: a plot without a bar (no
    # rounds) kept a scale about the ceiling line and its label off the bars' place
    ax.set_ylim(0, (block_size + 1) * 1.05)
    ax.set_xlim(-0.5, len(results) - 0.5 + width * (len(methods) - 1))
    ax.legend()
    fig.tight_layout()
    paths.append(save(fig, out_dir / PLOT_FILES[0]))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        for method, style in (("dspark", "-"), ("ngram", "--")):
            m = r.methods.get(method)
            if m:
                ys = [float("nan") if v is None else v for v in m["position_acceptance"]]
                ax.plot(range(block_size), ys, style, marker="o", label=f"{r.name} {method}")
    ax.set_xticks(range(block_size))
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(accept k | 0..k-1 accepted)")
    ax.set_title("Per-position conditional acceptance: accepted / reached (slot k verified, 0..k-1 "
                 "accepted)", fontsize=9)
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(save(fig, out_dir / PLOT_FILES[1]))
    plt.close(fig)
    return paths


PLOT_FILES = ("acceptance_length.png", "position_acceptance.png")
REPORT_FILES = ("report.md", "report.json", *PLOT_FILES)  # every file write_report writes in --out


def write_report(
    results: Sequence[WorkloadResult], out_dir: str | os.PathLike[str], meta: dict, *, block_size: int,
    also: Sequence[tuple[Path, str]] = (),
) -> dict[str, Path]:
    """Write the plots, report.md and report.json into ``out_dir``, as one: every file is
    written in full (fsynced) before the first replaces an earlier evaluation's, so a full disk
    leaves the earlier report whole, not a new report.md beside an old report.json (which
    export and the demo would take for the new one's).

    report.json is renamed into place last: its presence is what marks the evaluation
    finished (the demo skips an evaluation that has one); report.md just before it. ``also``:
    files written with them, renamed first (the calibration JSON the report describes)."""
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    intervals = uncertainty(results)  # once, for both files
    table = markdown_table(results, block_size=block_size, command=meta.get("command"), intervals=intervals,
                           settings=meta.get("settings"), draft=meta.get("draft_kind"),
                           calibration=meta.get("calibration"), num_prompts=meta.get("num_prompts_requested"))
    report = report_dict(results, meta, intervals=intervals)
    # which report.md this report.json was written with (export takes the table only beside it)
    report["report_md_sha256"] = text_digest(table)
    text = json.dumps(_jsonable(report), indent=2) + "\n"  # before any file: a failure here writes none
    rendered: list[tuple[Path, bytes]] = []

    def render(fig, path: Path) -> Path:
        rendered.append((path, _png(fig)))
        return path

    plots = plot(results, out, block_size=block_size, save=render)
    write_atomic_all([*also, *rendered, (out / "report.md", table), (out / "report.json", text)])
    return {"markdown": out / "report.md", **{path.stem: path for path in plots}, "json": out / "report.json"}


def text_digest(text: str) -> str:
    """The sha256 of ``text`` in UTF-8, as report.json records its report.md's."""
    import hashlib

    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _jsonable(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _save(fig, path: Path) -> Path:
    write_atomic(path, _png(fig))  # rendered in memory: a failed write leaves no temporary beside path
    return path


def _png(fig) -> bytes:
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=120)
    return image.getvalue()
