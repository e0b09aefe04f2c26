"""Session 58: ``eval compare --draws`` checked against the level the intervals are read at.

Since the intervals became expanded percentile intervals, a 95 % interval at 8 prompts is read
at about the 98.85 % level: its tails hold 0.57 % of the draws each, so 40 draws (the nominal
level's least) left both ends at the most extreme draw, an interval narrower than it says.
"""

from __future__ import annotations

import pytest
from test_evalmetrics_r29 import _report

from draftforge.cli import main


def _eight_prompts(tmp_path):
    return _report(tmp_path / "r", {"dspark": ([3, 4, 2, 5, 3, 4, 3, 2], [7, 9, 4, 12, 5, 8, 4, 3]),
                                     "ngram": ([4, 4, 3, 5, 4, 4, 3, 3], [6, 8, 5, 9, 6, 7, 5, 4])})  # fmt: skip


# By hand, from printed tables: t(0.975, 7) = 2.364624, times sqrt(8 / 7) is 2.527890, and
# Phi(-2.527890) = 0.005738, so the tails hold 2 x 0.005738 and 2 / 0.011476 = 174.3 draws;
# t(0.95, 7) = 1.894579 gives 2.025393, Phi(-2.025393) = 0.021414 and 2 / 0.042828 = 46.7.
@pytest.mark.parametrize("level,least", [("0.95", 175), ("0.9", 47)])
def test_draws_are_checked_at_the_expanded_level(tmp_path, capsys, level, least):
    report = _eight_prompts(tmp_path)
    assert main(["eval", "compare", str(report), "--draws", str(least), "--level", level]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("diff_macro=")
    assert main(["eval", "compare", str(report), "--draws", str(least - 1), "--level", level]) == 2
    err = capsys.readouterr().err
    assert (f"--draws {least - 1} is too few for a {level} interval at 8 prompts (workload 'w'): it is "
            "read at the expanded level 0.9") in err
    assert f"each of its tails needs a draw, so at least {least}" in err


def test_counts_whose_sums_would_overflow_are_refused(tmp_path, capsys):
    """Each count of 1e308 is finite, but eight of them sum to inf, and inf / inf made the
    acceptance length NaN with a verdict of "no rounds". Counts are whole numbers, exact in
    float64 below 2^53, which no real report comes near."""
    report = _report(tmp_path / "r", {"dspark": ([3, 4, 2, 5, 3, 4, 3, 1e308], [7, 9, 4, 12, 5, 8, 4, 1e308]),
                                       "ngram": ([4, 4, 3, 5, 4, 4, 3, 3], [6, 8, 5, 9, 6, 7, 5, 4])})  # fmt: skip
    assert main(["eval", "compare", str(report)]) == 2
    assert ("w/dspark: prompt_rounds[7] must be a count (a number from 0 to below 2^53), got 1e+308"
            in capsys.readouterr().err)
    top = _report(tmp_path / "top", {"dspark": ([3, 2**53 - 1], [7, 2**53 - 1]), "ngram": ([4, 4], [6, 8])})
    assert main(["eval", "compare", str(top), "--draws", "40"]) == 0  # the largest count is still one


def test_a_level_whose_expanded_tail_rounds_away_is_refused_not_a_traceback(tmp_path, capsys):
    """At 5 prompts the 0.999 interval is read at a tail of about 1e-7 a side: 1 - (1 - tail)
    rounded it to 0 and 2 / (1 - L) divided by zero (ZeroDivisionError)."""
    report = _report(tmp_path / "r", {"dspark": ([3, 4, 2, 5, 3], [7, 9, 4, 12, 5]),
                                       "ngram": ([4, 4, 3, 5, 4], [6, 8, 5, 9, 6])})  # fmt: skip
    assert main(["eval", "compare", str(report), "--level", "0.999"]) == 2
    err = capsys.readouterr().err
    assert "too few for a 0.999 interval at 5 prompts" in err and "lower --level" in err
