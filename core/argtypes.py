"""argparse ``type=`` checkers shared by the commands: a value out of range is refused with
the option's name and the reason (argparse's usage error, exit status 2) before any work."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence


def _bounded(kind: type, low: float | None, high: float | None, why: str, *,
             above_low: bool = False) -> Callable[[str], float]:
    """A parser of ``kind`` within [low, high] (above ``low`` when ``above_low``); a float
    must be finite, as in a recipe (``inf`` passes a lower bound, and ``nan`` fails it with a
    misleading reason)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        too_low = low is not None and not (value > low if above_low else value >= low)
        if too_low or (high is not None and not value <= high):
            raise argparse.ArgumentTypeError(f"{why}, got {text}")
        return value

    return parse


MAX_SEED = 2**32 - 1  # every seed the recipes and commands take: derived seeds stay in torch's range

positive_int = _bounded(int, 1, None, "must be at least 1")
block_size = _bounded(int, 2, None, "must be at least 2 (the anchor and one drafted slot), as draft.block_size")
seed = _bounded(int, 0, MAX_SEED, f"must be a seed, 0..{MAX_SEED}")
non_negative_int = _bounded(int, 0, None, "must be 0 or more")
port = _bounded(int, 1, 65535, "must be a TCP port, 1..65535")
non_negative_float = _bounded(float, 0.0, None, "must be 0 or more")
positive_float = _bounded(float, 0.0, None, "must be greater than 0", above_low=True)
probability = _bounded(float, 0.0, 1.0, "must lie in [0, 1]")
nucleus = _bounded(float, 0.0, 1.0, "must lie in (0, 1]", above_low=True)


def path(text: str) -> str:
    """A path that is not empty: ``--out ""`` (an unset shell variable) would mean the current
    directory to ``Path``, and write there."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty path; give a file or folder")
    return text


def names(valid: Sequence[str]) -> Callable[[str], list[str]]:
    """A comma-separated, non-empty subset of ``valid``, each name once (in the order given)."""

    def parse(text: str) -> list[str]:
        chosen = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
        if not chosen:  # "" or ",": said as such, not as an unknown name
            raise argparse.ArgumentTypeError(f"no name given; valid: {', '.join(valid)}")
        unknown = [n for n in chosen if n not in valid]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")
        return chosen

    return parse


def _int_list(each: Callable[[str], int]) -> Callable[[str], list[int]]:
    """A comma-separated, non-empty list of integers, each checked by ``each``."""

    def parse(text: str) -> list[int]:
        parts = [part for part in text.split(",") if part.strip()]
        if not parts:
            raise argparse.ArgumentTypeError("empty list")
        return [each(part) for part in parts]

    return parse


positive_ints = _int_list(positive_int)  # each at least 1
non_negative_ints = _int_list(non_negative_int)  # each 0 or more
