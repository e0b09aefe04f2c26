"""Per-position temperature scaling of the confidence head, in SGLang's calibration format.

The confidence logit ``z_k`` of draft position k estimates the probability that
token k is accepted given that tokens ``0 .. k-1`` were. A verification round
therefore gives one labelled sample per position it reached: positions
``k <= accepted`` among the verified ones, label ``k < accepted``. Per position,
a temperature ``T_k`` minimises the log loss of ``sigmoid(z_k / T_k)`` on
fitting rounds; the expected calibration error (ECE, equal-width bins) is
measured before and after on held-out rounds: ``draftforge eval`` holds out every
second prompt of each workload, so they come from other prompts than the fitted rounds. It is the
error of each position's own acceptance given the earlier ones were accepted, in
10 bins; SGLang's own fitter writes, under the same names, the error of the
cumulative (survival) probability in 15 bins, so the ECE figures of the two are not
comparable, while the temperatures are. :func:`calibrate_survival` (``--calibrate-rule
survival``) fits and measures by SGLang's own rule instead, on whole rounds.

SGLang (``--speculative-algorithm DSPARK``, sequential temperature scaling)
reads ``{"temperatures": [T_0 .. T_{γ-1}], "ece_before": [...], "ece_after":
[...], "dataset": str, "num_samples": int}``, every temperature > 0. The file also
carries ``fit_samples`` and ``held_out_samples`` per position: a position with fewer
than ``MIN_FIT_SAMPLES`` fitting samples keeps T = 1 (one sample fits any temperature
perfectly), and ``temperature_at_bound`` says, per position, whether the fit stopped at a bound
of its search (``"upper"``, ``"lower"``, else null; see :func:`bound_hit`).

A position with no held-out sample has no ECE: :func:`calibrate` gives None there (null in
report.json's ``calibration``; "n/a" in report.md), never 0, which would claim a perfect
calibration nobody measured. SGLang's reader (0.5.23, ``dspark_sts.py``) decodes
``ece_before`` / ``ece_after`` as ``list[float]`` (msgspec: a null fails the server's start, and
JSON has no NaN), with an empty list as its default for "none given": so
:func:`write_calibration` writes the two lists into SGLang's file only when every position has
its ECE, and empty lists otherwise (``held_out_samples`` says which positions had none; the
measured ones are in report.json). SGLang reads only the temperatures.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path

import torch

from draftforge.errors import InputError
from draftforge.eval.speculative import Round
from draftforge.files import write_atomic

MIN_TEMPERATURE = 0.05  # all-rejected positions would otherwise drive T to 0
MAX_TEMPERATURE = 100.0  # see bound_hit: a fit that stops here is not a fitted value
MIN_FIT_SAMPLES = 8  # below this a position keeps T = 1


def round_samples(rounds: Iterable[Round]) -> list[tuple[int, float, float]]:
    """(position, confidence logit, accepted 0/1) for every position a round reached."""
    samples = []
    for r in rounds:
        if r.confidence_logits is None:
            continue
        reached = min(r.num_verified, r.num_accepted + 1)
        for k in range(reached):
            samples.append((k, float(r.confidence_logits[k]), 1.0 if k < r.num_accepted else 0.0))
    return samples


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor, *, iterations: int = 80) -> float:
    """The T in [MIN_TEMPERATURE, MAX_TEMPERATURE] minimising the mean log loss of
    ``sigmoid(logits / T)``. The loss is convex in a = 1/T, so its derivative rises with a:
    bisection on the derivative's sign over log a finds the minimum, or the bound it lies
    beyond, whatever the logits' scale (Newton's step stalls where saturated logits make the
    curvature vanish while the slope does not)."""
    z, y = logits.double(), labels.double()
    if z.numel() == 0 or not bool(z.ne(0).any()):
        return 1.0  # no data, or logits that no temperature changes

    def slope(a: float) -> float:
        return float(((torch.sigmoid(a * z) - y) * z).sum())

    low, high = math.log(1.0 / MAX_TEMPERATURE), math.log(1.0 / MIN_TEMPERATURE)
    if slope(math.exp(low)) >= 0:
        return MAX_TEMPERATURE
    if slope(math.exp(high)) <= 0:
        return MIN_TEMPERATURE
    for _ in range(iterations):
        middle = 0.5 * (low + high)
        if slope(math.exp(middle)) < 0:
            low = middle
        else:
            high = middle
    return float(1.0 / math.exp(0.5 * (low + high)))


def bound_hit(temperature: float) -> str | None:
    """``"upper"`` or ``"lower"`` where :func:`fit_temperature` stopped at a bound of its
    search ([MIN_TEMPERATURE, MAX_TEMPERATURE]) because the log loss still fell beyond it, else
    None (the bisection's interior result never equals a bound, nor does the T = 1 kept without
    enough samples). Such a temperature is the best one the search allows, not a minimum it
    found: at the upper bound (100) the log loss falls on as T grows, i.e. as
    ``sigmoid(z / T)`` flattens towards 0.5 whatever the logit: the confidence logits at that
    position predict the outcome worse than a constant, as when nearly every draft is rejected
    while the head says accept. The file keeps the bound (SGLang needs a number above 0, and
    it is the loss's best in range); the report says it is the bound, not a fitted value."""
    if temperature == MAX_TEMPERATURE:
        return "upper"
    if temperature == MIN_TEMPERATURE:
        return "lower"
    return None


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, *, num_bins: int = 10) -> float:
    """ECE with equal-width probability bins: sum over bins of |mean label - mean prob| x bin share."""
    if probs.numel() == 0:
        return float("nan")
    probs, labels = probs.double(), labels.double()
    bins = torch.clamp((probs * num_bins).long(), max=num_bins - 1)
    total = 0.0
    for b in range(num_bins):
        mask = bins == b
        if mask.any():
            total += float(mask.double().mean()) * abs(float(labels[mask].mean() - probs[mask].mean()))
    return total


def calibrate(
    samples: Sequence[tuple[int, float, float]],
    block_size: int,
    *,
    dataset: str = "",
    holdout_every: int = 2,
    prompt_ids: Sequence[tuple[Hashable, int]] | None = None,
) -> dict:
    """Fit one temperature per position on most samples and measure ECE on the held-out rest.

    With ``prompt_ids`` (each sample's ``(workload, prompt index in that workload)``, as
    ``draftforge eval`` passes), every ``holdout_every``-th prompt of each workload is held out
    (index ``holdout_every - 1``, ``2 * holdout_every - 1``, ...; a prompt that gave no sample
    still counts): the held-out rounds come from other prompts than the fitted ones, so the
    ECE after is not an in-sample figure. Without, every ``holdout_every``-th sample of a position is held out
    (deterministic). ECE before and after is measured on the held-out samples alone. A position with fewer than
    ``MIN_FIT_SAMPLES`` fitting samples keeps T = 1; one without held-out samples has
    ECE None (not measured: see the module's note on SGLang's file); ``fit_samples`` and
    ``held_out_samples`` say which is which, ``temperature_at_bound`` which temperatures are a
    bound of the search (:func:`bound_hit`). ``held_out`` (not written to SGLang's
    file) lists the held-out samples, for a pooled ECE over positions. A NaN or infinite
    confidence logit is refused (:class:`InputError`). ``holdout_every`` is a whole number >= 2
    (:class:`ValueError` else): 1 would hold out every prompt and fit on none, 0 divides by
    zero, and a negative one would hold out none.
    """
    _check_holdout(holdout_every, prompt_ids, len(samples), "samples")
    temperatures, ece_before, ece_after, fit_counts, held_counts, bounds = [], [], [], [], [], []
    held_out: list[tuple[int, float, float]] = []
    _check_finite(samples)
    for k in range(block_size):
        at_k = [i for i, sample in enumerate(samples) if sample[0] == k]
        if prompt_ids is None:
            held = {i for n, i in enumerate(at_k) if n % holdout_every == holdout_every - 1}
        else:
            held = {i for i in at_k if prompt_ids[i][1] % holdout_every == holdout_every - 1}
        fit_rows = [samples[i][1:] for i in at_k if i not in held]
        held_rows = [samples[i][1:] for i in at_k if i in held]
        temperature = 1.0
        if len(fit_rows) >= MIN_FIT_SAMPLES:
            z_fit = torch.tensor([z for z, _ in fit_rows], dtype=torch.float64)
            y_fit = torch.tensor([y for _, y in fit_rows], dtype=torch.float64)
            temperature = fit_temperature(z_fit, y_fit)
        z_held = torch.tensor([z for z, _ in held_rows], dtype=torch.float64)
        y_held = torch.tensor([y for _, y in held_rows], dtype=torch.float64)
        temperatures.append(temperature)
        bounds.append(bound_hit(temperature))
        ece_before.append(expected_calibration_error(torch.sigmoid(z_held), y_held))
        ece_after.append(expected_calibration_error(torch.sigmoid(z_held / temperature), y_held))
        fit_counts.append(len(fit_rows))
        held_counts.append(len(held_rows))
        held_out += [(k, z, y) for z, y in held_rows]
    return {
        "temperatures": temperatures,
        "ece_before": [_measured(e) for e in ece_before],
        "ece_after": [_measured(e) for e in ece_after],
        "dataset": dataset,
        "num_samples": len(samples),
        "fit_samples": fit_counts,
        "held_out_samples": held_counts,
        "temperature_at_bound": bounds,
        "held_out": held_out,
    }


def _check_holdout(holdout_every: int, prompt_ids: Sequence[tuple[Hashable, int]] | None, count: int,
                   what: str) -> None:
    """Refuse a ``holdout_every`` that is no whole number >= 2, and ``prompt_ids`` that are not one
    (workload, prompt index >= 0) pair for each of the ``count`` samples (or rounds: ``what``)."""
    if isinstance(holdout_every, bool) or not isinstance(holdout_every, int) or holdout_every < 2:
        raise ValueError(
            f"holdout_every must be a whole number >= 2 (every holdout_every-th prompt is held out, "
            f"the others fitted on), got {holdout_every!r}"
        )
    if prompt_ids is not None and len(prompt_ids) != count:
        raise ValueError(f"{len(prompt_ids)} prompt ids for {count} {what}")
    for n, prompt in enumerate(prompt_ids or ()):
        if not (isinstance(prompt, tuple) and len(prompt) == 2 and isinstance(prompt[1], int) and prompt[1] >= 0):
            raise ValueError(f"prompt_ids[{n}] must be a (workload, prompt index >= 0) pair, got {prompt!r}")


def _check_finite(samples: Sequence[tuple[int, float, float]]) -> None:
    """Refuse NaN or infinite confidence logits: one NaN made the fit's slope NaN and the
    temperature its upper bound, and NaN probabilities fell in no ECE bin, so a draft whose
    confidence head gives NaN everywhere was reported perfectly calibrated (ECE 0)."""
    bad = Counter(k for k, z, _ in samples if not math.isfinite(z))
    if bad:
        where = ", ".join(f"{count} at position {k}" for k, count in sorted(bad.items()))
        raise InputError(
            f"calibration: the draft's confidence head gave {bad.total()} non-finite logits (NaN or "
            f"inf) of {len(samples)} ({where}): no temperature fits them; check the draft for "
            "non-finite weights (a diverged training?) before calibrating it"
        )


def pooled_ece(samples: Sequence[tuple[int, float, float]], temperatures: Sequence[float] | None = None) -> float:
    """ECE over all positions together, raw or with the per-position temperatures applied."""
    if not samples:
        return float("nan")
    z = torch.tensor([s[1] for s in samples], dtype=torch.float64)
    if temperatures is not None:
        z = z / torch.tensor([temperatures[s[0]] for s in samples], dtype=torch.float64)
    y = torch.tensor([s[2] for s in samples], dtype=torch.float64)
    return expected_calibration_error(torch.sigmoid(z), y)


def write_calibration(path: str | os.PathLike[str], calibration: dict) -> Path:
    """Write SGLang's calibration JSON (:func:`calibration_json`) atomically (temp file, then rename)."""
    path = Path(path).expanduser()
    write_atomic(path, calibration_json(calibration).encode())
    return path


def calibration_json(calibration: dict) -> str:
    """SGLang's calibration JSON of ``calibration``. ``ece_before`` and ``ece_after`` go in whole
    or as empty lists (SGLang's default): SGLang decodes them as lists of floats, so a position
    without an ECE (None) cannot be written as null; 0 would claim a perfect calibration nobody
    measured (see the module's docstring)."""
    # NaN passes "t <= 0", and json writes NaN / Infinity, which no JSON reader (SGLang's) takes
    if not calibration["temperatures"] or any(not (math.isfinite(t) and t > 0) for t in calibration["temperatures"]):
        raise ValueError(f"calibration temperatures must be non-empty, finite and > 0: {calibration['temperatures']}")
    # the held-out samples and the pooled ECE (NaN where nothing was held out: JSON has no NaN)
    # are report.json's
    written = {key: value for key, value in calibration.items()
               if key not in ("held_out", "pooled_ece_before", "pooled_ece_after")}
    if any(e is None for key in ("ece_before", "ece_after") for e in written.get(key, ())):
        written["ece_before"], written["ece_after"] = [], []
    return json.dumps(written, indent=2) + "\n"


def _measured(value: float) -> float | None:
    # an ECE of no sample (NaN) is not measured: None, not 0 (a perfect calibration)
    return None if math.isnan(value) else value


# SGLang's own fitter (sglang.benchmark.dspark_sts_fit, 0.5.23): a grid of 41 temperatures,
# evenly spaced in log between 0.1 and 10, and the survival ECE in 15 equal-width bins
SURVIVAL_GRID = tuple(10.0 ** (-1.0 + 2.0 * i / 40) for i in range(41))
SURVIVAL_ECE_BINS = 15


def round_outcomes(rounds: Iterable[Round], block_size: int) -> list[tuple[list[float], int]]:
    """(the round's ``block_size`` confidence logits, drafts accepted) for every round whose
    every position's outcome is known: all ``block_size`` drafts verified, or one rejected
    among those verified (the positions after it are then rejected too). A round cut short by
    the output's end (fewer drafts sent, or an accepted end-of-sequence) is left out: whether
    its later drafts would have been accepted was never measured."""
    outcomes = []
    for r in rounds:
        logits = r.confidence_logits
        if logits is None or len(logits) < block_size:
            continue
        if r.num_verified >= block_size or r.num_accepted < r.num_verified:
            outcomes.append(([float(z) for z in logits[:block_size]], int(r.num_accepted)))
    return outcomes


def survival_ece(logits: torch.Tensor, accepted: torch.Tensor, temperatures: Sequence[float],
                 position: int) -> float:
    """SGLang's ECE at ``position``: the survival probability prod_{i<=k} sigmoid(z_i / T_i)
    against 'drafts 0..k all accepted', in :data:`SURVIVAL_ECE_BINS` bins."""
    scale = torch.tensor(list(temperatures[: position + 1]), dtype=torch.float64)
    survival = torch.sigmoid(logits[:, : position + 1] / scale).prod(dim=1)
    return expected_calibration_error(survival, (accepted > position).double(), num_bins=SURVIVAL_ECE_BINS)


def calibrate_survival(
    outcomes: Sequence[tuple[Sequence[float], int]],
    block_size: int,
    *,
    dataset: str = "",
    holdout_every: int = 2,
    prompt_ids: Sequence[tuple[Hashable, int]] | None = None,
) -> dict:
    """SGLang's sequential temperature scaling, fitted as ``sglang.benchmark.dspark_sts_fit``
    fits it, on rounds (:func:`round_outcomes`) instead of its collected shards: position by
    position, the temperature of :data:`SURVIVAL_GRID` (the smallest on a tie) minimising the
    survival ECE (:func:`survival_ece`) with the earlier positions' temperatures as fitted.
    Held out as :func:`calibrate` holds out (whole prompts with ``prompt_ids``, else every
    ``holdout_every``-th round); ``ece_before`` / ``ece_after`` are the survival ECE on the
    held-out rounds, what SGLang's fitter writes under those names (it measures on the rounds
    it fitted). Fewer than ``MIN_FIT_SAMPLES`` fitting rounds keep T = 1 everywhere. The dict
    has :func:`calibrate`'s keys (``num_samples``, ``fit_samples`` and ``held_out_samples``
    count rounds; ``temperature_at_bound`` is ``"lower"`` / ``"upper"`` at the grid's ends),
    ``pooled_ece_before`` / ``pooled_ece_after`` over every position of the held-out rounds,
    and ``rule: "survival"``."""
    _check_holdout(holdout_every, prompt_ids, len(outcomes), "rounds")
    _check_finite([(k, z, 0.0) for logits, _ in outcomes for k, z in enumerate(logits[:block_size])])
    held = [(prompt_ids[i][1] if prompt_ids is not None else i) % holdout_every == holdout_every - 1
            for i in range(len(outcomes))]

    def tensors(rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.tensor([list(outcomes[i][0][:block_size]) for i in rows], dtype=torch.float64)
        return logits.reshape(len(rows), block_size), torch.tensor([outcomes[i][1] for i in rows])

    fit_z, fit_accepted = tensors([i for i, h in enumerate(held) if not h])
    held_z, held_accepted = tensors([i for i, h in enumerate(held) if h])
    ones = [1.0] * block_size
    temperatures: list[float] = []
    for k in range(block_size):
        best = 1.0
        if len(fit_z) >= MIN_FIT_SAMPLES:
            scores = [(survival_ece(fit_z, fit_accepted, [*temperatures, t], k), t) for t in SURVIVAL_GRID]
            best = min(scores, key=lambda score: score[0])[1]  # the first (smallest T) on a tie
        temperatures.append(best)

    def measured(temps: Sequence[float], k: int) -> float | None:
        return _measured(survival_ece(held_z, held_accepted, temps, k)) if len(held_z) else None

    def pooled(temps: Sequence[float]) -> float:
        if not len(held_z):
            return float("nan")
        scale = torch.tensor(list(temps), dtype=torch.float64)
        survival = torch.sigmoid(held_z / scale).cumprod(dim=1)
        labels = (held_accepted.unsqueeze(1) > torch.arange(block_size)).double()
        return expected_calibration_error(survival.flatten(), labels.flatten(), num_bins=SURVIVAL_ECE_BINS)

    fitted = len(fit_z) >= MIN_FIT_SAMPLES
    return {
        "temperatures": temperatures,
        "ece_before": [measured(ones, k) for k in range(block_size)],
        "ece_after": [measured(temperatures, k) for k in range(block_size)],
        "dataset": dataset,
        "num_samples": len(outcomes),
        "fit_samples": [len(fit_z)] * block_size,
        "held_out_samples": [len(held_z)] * block_size,
        "temperature_at_bound": [None if not fitted else "lower" if t == SURVIVAL_GRID[0]
                                 else "upper" if t == SURVIVAL_GRID[-1] else None for t in temperatures],
        "rule": "survival",
        "pooled_ece_before": pooled(ones),
        "pooled_ece_after": pooled(temperatures),
    }
