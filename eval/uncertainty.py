"""How much an acceptance length measured on a few prompts can be trusted: bootstrap over prompts.

Greedy decoding is deterministic, so the only chance in a measured acceptance
length (AL) is which prompts the workload drew. A workload's AL is pooled over
its rounds (the accepted drafts plus the bonus token of every round, over the
number of rounds: a ratio of sums), so prompts that run more rounds weigh more.
The bootstrap resamples a workload's prompts with replacement, recomputes the
pooled AL, and reads the percentile interval off the draws:

- one workload's AL: resample its prompts;
- the macro mean over workloads: resample each workload's prompts on its own
  (a stratified draw) and average the workloads' ALs;
- the difference between two methods on the same prompts (a paired
  comparison): one draw of prompt indices serves both methods, so what the two
  share (a prompt that is easy for both) cancels.

A difference whose interval lies above zero is reported as *ahead*, below zero
as *behind*, and otherwise as *not distinguishable* with these prompts; with
fewer than :data:`MIN_PROMPTS` prompts in a workload the resamples cannot show
the spread (one prompt gives a zero-width interval), and the verdict is *too
few prompts*. Only prompts with a verification round count: one that ended at
its first token adds nothing to either sum. A method that ran no verification
round at all (every prompt ended at its first token) has no acceptance length:
its interval reads ``-``, and a difference with it *no rounds*. A method that
ran rounds on some prompts only has no acceptance length on a draw that
resampled none of those: such draws are left out of the interval, which then
holds for the draws with a round, and their number is kept (``dropped``) for
the output to say. The interval says nothing about prompts
unlike the workload's, and with 8 prompts a workload the percentile interval
is itself rough; more prompts narrow it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from draftforge.errors import InputError

DRAWS = 10_000
LEVEL = 0.95
SEED = 0
MIN_PROMPTS = 5  # per workload, for a verdict


@dataclass(frozen=True)
class PromptTotals:
    """One method on one workload, prompt by prompt: verification rounds and their summed AL."""

    rounds: np.ndarray  # rounds per prompt
    al_sum: np.ndarray  # sum over the prompt's rounds of (accepted drafts + 1)

    @classmethod
    def from_summary(cls, summary: dict, where: str) -> PromptTotals:
        """From one method's entry of ``report.json`` (``prompt_rounds``, ``prompt_al_sum``).

        A hand-edited or damaged report is refused naming the key and the prompt: every
        prompt's rounds (a whole number) and summed AL are numbers >= 0, each round counts at
        least 1, and a prompt without a round sums to 0."""
        if not isinstance(summary, dict):
            raise InputError(f"{where}: a method's entry must be a table, got {type(summary).__name__}")
        rounds, al_sum = summary.get("prompt_rounds"), summary.get("prompt_al_sum")
        if rounds is None or al_sum is None:
            raise InputError(
                f"{where}: no per-prompt totals (prompt_rounds, prompt_al_sum); the report was "
                "written by an older draftforge eval: run the evaluation again"
            )
        rounds, al_sum = _counts(rounds, "prompt_rounds", where), _counts(al_sum, "prompt_al_sum", where)
        if len(rounds) != len(al_sum) or not rounds:
            raise InputError(f"{where}: prompt_rounds and prompt_al_sum must be equal, non-empty lists")
        for index, (n, total) in enumerate(zip(rounds, al_sum, strict=True)):
            if n != int(n):
                raise InputError(f"{where}: prompt {index}: prompt_rounds {n} is not a whole number of rounds")
            if n == 0 and total != 0:  # it would add tokens to the pooled AL without a round
                raise InputError(
                    f"{where}: prompt {index}: prompt_al_sum {total} with prompt_rounds 0 "
                    "(a prompt without a round accepts nothing)"
                )
            if total < n:  # every round counts the bonus token or an accepted end of sequence
                raise InputError(
                    f"{where}: prompt {index}: prompt_al_sum {total} is below prompt_rounds {n} "
                    "(each round counts at least 1)"
                )
        return cls(np.asarray(rounds, dtype=np.float64), np.asarray(al_sum, dtype=np.float64))

    def __len__(self) -> int:
        return len(self.rounds)

    def with_rounds(self) -> int:
        """The prompts that ran a verification round: the others add nothing to the pooled AL."""
        return int((self.rounds > 0).sum())

    def pooled(self) -> float:
        total = self.rounds.sum()
        return float(self.al_sum.sum() / total) if total > 0 else math.nan


def _counts(values, key: str, where: str) -> list[float]:
    """``values`` as a list of finite numbers >= 0, or an InputError naming ``key``: numpy
    would turn a string into a traceback, and a nested list or a negative count into a
    plausible acceptance length."""
    if not isinstance(values, list):
        raise InputError(f"{where}: {key} must be a list of counts, one per prompt, got {type(values).__name__}")
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
            raise InputError(f"{where}: {key}[{index}] must be a count (a number >= 0), got {value!r}")
    return values


@dataclass(frozen=True)
class Interval:
    """A point estimate on the measured prompts and its bootstrap percentile interval."""

    value: float
    low: float
    high: float
    level: float
    draws: int
    prompts: int  # the fewest prompts with a round, of any method and workload in the estimate
    dropped: int = 0  # draws left out: they resampled no prompt with a round (of a or b)

    def verdict(self) -> str:
        """For a difference: which side of zero the whole interval lies on."""
        if math.isnan(self.value):
            return "no rounds"  # a method ran no verification round: no acceptance length
        if self.prompts < MIN_PROMPTS:
            return "too few prompts"
        if self.low > 0:
            return "ahead"
        if self.high < 0:
            return "behind"
        return "not distinguishable"

    def as_dict(self) -> dict:
        return {"value": self.value, "low": self.low, "high": self.high, "level": self.level,
                "draws": self.draws, "prompts": self.prompts, "dropped": self.dropped}  # fmt: skip


def _pooled_draws(totals: PromptTotals, index: np.ndarray) -> np.ndarray:
    rounds = totals.rounds[index].sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(rounds > 0, totals.al_sum[index].sum(axis=1) / rounds, np.nan)


def bootstrap(
    workloads: Sequence[tuple[PromptTotals, PromptTotals | None]],
    *,
    draws: int = DRAWS,
    level: float = LEVEL,
    seed: int = SEED,
) -> Interval:
    """The mean over workloads of ``AL(a) - AL(b)`` (``AL(a)`` where ``b`` is None), with its interval.

    Prompts are resampled within each workload, the same indices for ``a`` and ``b``
    (which must therefore hold the same prompts in the same order). A draw in which a
    workload resampled no prompt with a round (of ``a`` or ``b``) has no value: it is left
    out of the interval and counted in ``dropped``.
    """
    if not workloads:
        raise ValueError("bootstrap needs at least one workload")
    if draws < 1 or not 0 < level < 1:
        raise ValueError(f"need draws >= 1 and 0 < level < 1, got draws={draws}, level={level}")
    rng = np.random.default_rng(seed)
    value, sampled = 0.0, np.zeros(draws)
    for a, b in workloads:
        if b is not None and len(a) != len(b):
            raise ValueError(f"a paired comparison needs the same prompts: {len(a)} against {len(b)}")
        index = rng.integers(0, len(a), size=(draws, len(a)))
        value += a.pooled() - (b.pooled() if b is not None else 0.0)
        sampled += _pooled_draws(a, index) - (_pooled_draws(b, index) if b is not None else 0.0)
    value /= len(workloads)
    sampled /= len(workloads)
    tail = 100 * (1 - level) / 2
    kept = sampled[np.isfinite(sampled)]
    low, high = np.percentile(kept, [tail, 100 - tail]) if kept.size else (math.nan,) * 2
    prompts = min(t.with_rounds() for pair in workloads for t in pair if t is not None)
    return Interval(float(value), float(low), float(high), level, draws, prompts, draws - kept.size)


def by_workload(
    workloads: dict[str, tuple[PromptTotals, PromptTotals | None]], **kw
) -> dict[str, Interval]:
    """:func:`bootstrap` for each workload on its own, then ``"macro"`` over all of them."""
    out = {name: bootstrap([pair], **kw) for name, pair in workloads.items()}
    out["macro"] = bootstrap(list(workloads.values()), **kw)
    return out


def interval_text(value: float, low: float, high: float, signed: bool = False) -> str:
    """``1.23 (1.10 to 1.40)``; with ``signed``, ``+0.05 (-0.02 to +0.11)``; ``-`` without a
    value (no verification round), as the report's other cells."""
    if math.isnan(value):
        return "-"
    sign = "+" if signed else ""
    return f"{value:{sign}.2f} ({low:{sign}.2f} to {high:{sign}.2f})"


def prompt_digest(prompts: Sequence[Sequence[int]]) -> str:
    """A short fingerprint of a workload's prompt token ids: paired comparisons across
    reports refuse prompts that differ."""
    payload = json.dumps([list(map(int, p)) for p in prompts], separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def report_uncertainty(workloads: dict[str, dict[str, PromptTotals]], *, reference: str = "dspark",
                       draws: int = DRAWS, level: float = LEVEL, seed: int = SEED) -> dict:
    """Intervals for every method's AL (per workload and macro) and for ``reference`` minus
    each other method but ``none`` (always 1), paired on the same prompts.
    ``workloads``: name -> method -> totals."""
    names = list(workloads)
    methods = [m for m in dict.fromkeys(m for per in workloads.values() for m in per)
               if all(m in workloads[n] for n in names)]
    kw = {"draws": draws, "level": level, "seed": seed}
    out: dict = {"level": level, "draws": draws, "seed": seed, "acceptance_length": {}, "paired": {}}
    for method in methods:
        per = by_workload({n: (workloads[n][method], None) for n in names}, **kw)
        out["acceptance_length"][method] = {n: iv.as_dict() for n, iv in per.items()}
    if reference in methods:
        for other in (m for m in methods if m not in (reference, "none")):  # none's AL is 1
            per = by_workload({n: (workloads[n][reference], workloads[n][other]) for n in names}, **kw)
            out["paired"][f"{reference}-{other}"] = {
                n: {**iv.as_dict(), "verdict": iv.verdict()} for n, iv in per.items()
            }
    return out
