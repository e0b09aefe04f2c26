"""How much an acceptance length measured on a few prompts can be trusted: bootstrap over prompts.

Greedy decoding is deterministic, so the only chance in a measured acceptance
length (AL) is which prompts the workload drew. A workload's AL is pooled over
its rounds (the accepted drafts plus the bonus token of every round, over the
number of rounds: a ratio of sums), so prompts that run more rounds weigh more.
The bootstrap resamples a workload's prompts with replacement, recomputes the
pooled AL, and reads the percentile interval off the draws, at a level expanded
for few prompts (:func:`expanded_level`; the plain percentile interval is too
narrow at 8 prompts):

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
unlike the workload's, and with 8 prompts a workload the interval is itself
rough; more prompts narrow it.
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


MAX_COUNT = 2**53  # counts are exact in float64 below it, and no sum of them overflows


def _counts(values, key: str, where: str) -> list[float]:
    """``values`` as a list of numbers from 0 to below 2^53, or an InputError naming ``key``:
    numpy would turn a string into a traceback, a nested list or a negative count into a
    plausible acceptance length, and finite counts near 1e308 into sums of inf and an
    acceptance length of NaN."""
    if not isinstance(values, list):
        raise InputError(f"{where}: {key} must be a list of counts, one per prompt, got {type(values).__name__}")
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < MAX_COUNT:
            raise InputError(
                f"{where}: {key}[{index}] must be a count (a number from 0 to below 2^53), got {value!r}"
            )
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
    kept = sampled[np.isfinite(sampled)]
    prompts = min(t.with_rounds() for pair in workloads for t in pair if t is not None)
    tail = 100 * (1 - expanded_level(level, prompts)) / 2
    low, high = np.percentile(kept, [tail, 100 - tail]) if kept.size else (math.nan,) * 2
    return Interval(float(value), float(low), float(high), level, draws, prompts, draws - kept.size)


def expanded_level(level: float, prompts: int) -> float:
    """The percentile level the bootstrap reads its ``level`` interval at, for ``prompts`` prompts
    (the fewest of any workload in the estimate): the expanded percentile interval (Hesterberg,
    "What teachers should know about the bootstrap", 2015), whose tail is
    ``Phi(-sqrt(n / (n - 1)) * t(n - 1))`` for a two-sided ``t`` quantile at ``level``.

    The plain percentile interval is too narrow for few prompts: the bootstrap's spread is the
    sample's, shrunk by (n - 1) / n, and read as a normal one where a t with n - 1 degrees of
    freedom applies. Simulated per-prompt round data covered the truth about 89 % of the time
    at 8 prompts and 84 % at 5 under a nominal 95 %, and two equal methods were called ahead or
    behind about twice as often as 5 %; expanded, 6 % at 8 prompts. Fewer than 2 prompts: the
    level itself (one prompt gives a zero-width interval, too few for a verdict anyway)."""
    if prompts < 2:
        return level
    return 1 - 2 * expanded_tail(level, prompts)


def expanded_tail(level: float, prompts: int) -> float:
    """The share of the draws in each tail of a ``level`` interval read at ``prompts`` prompts:
    ``(1 - level) / 2`` below 2 prompts, else ``Phi(-sqrt(n / (n - 1)) * t(n - 1))``, computed
    directly (``1 - (1 - tail)`` rounds a tiny tail to 0: at 5 prompts and level 0.999 it is
    about 1e-7)."""
    if prompts < 2:
        return (1 - level) / 2
    t = t_quantile(1 - (1 - level) / 2, prompts - 1)
    # Phi(-x) as erfc(x / sqrt 2) / 2: through erf, 1 + erf(-x / sqrt 2) is 0 from x of about 8.3
    return math.erfc(math.sqrt(prompts / (prompts - 1)) * t / math.sqrt(2)) / 2


def least_draws(level: float, prompts: int = 0) -> float:
    """The fewest bootstrap draws that leave a draw in each tail of a ``level`` interval read at
    ``prompts`` prompts (its expanded level; the nominal one below 2 prompts): ``1 / tail``,
    rounded as a message rounds it (20 draws at 0.9, where ``1 - 0.9`` is 0.0999...); inf where
    the tail is 0 in floating point. With fewer, an interval end is the most extreme draw,
    narrower than the level says."""
    tail = expanded_tail(level, prompts)
    return math.ceil(round(1 / tail, 9)) if tail > 0 else math.inf


def t_quantile(p: float, dof: int) -> float:
    """The ``p`` quantile (p > 0.5) of Student's t with ``dof`` degrees of freedom, by bisection
    on its upper tail ``0.5 * I_{dof / (dof + t^2)}(dof / 2, 1 / 2)`` (numpy has no t quantile,
    and scipy is not a dependency)."""
    if not 0.5 < p < 1 or dof < 1:
        raise ValueError(f"need 0.5 < p < 1 and dof >= 1, got p={p}, dof={dof}")
    low, high = 0.0, 1.0
    while 0.5 * _betainc(dof / 2, 0.5, dof / (dof + high * high)) > 1 - p:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        if 0.5 * _betainc(dof / 2, 0.5, dof / (dof + mid * mid)) > 1 - p:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function ``I_x(a, b)``, by its continued fraction
    (modified Lentz), on the side of ``x`` where it converges fast."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _beta_fraction(a, b, x) / a
    return 1 - front * _beta_fraction(b, a, 1 - x) / b


def _beta_fraction(a: float, b: float, x: float) -> float:
    tiny = 1e-300

    def kept(value: float) -> float:
        return tiny if abs(value) < tiny else value

    c, d = 1.0, 1 / kept(1 - (a + b) * x / (a + 1))
    fraction = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 / kept(1 + numerator * d)
            c = kept(1 + numerator / c)
            fraction *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return fraction


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
