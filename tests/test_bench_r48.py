"""bench objective measures one step after the objective's one-time caches exist, and reports
those apart (session 48: the chunked path's peak held its joined head and packed lm_head,
which a trainer builds once and keeps, while the unchunked path builds neither)."""

import re

from draftforge.train import bench_objective as bo


def chunked_figures(capsys, *options: str) -> tuple[float, float, str]:
    """(kept between steps, the step's peak added, the output) of the chunked path's benchmark
    with ``options`` (one thread)."""
    assert bo.main([*options, "--threads", "1", "--paths", "chunked"]) == 0
    out = capsys.readouterr().out
    kept = float(re.search(r"chunked .* kept between steps\s+([0-9.]+) GiB", out).group(1))
    return kept, float(out.strip().splitlines()[-1].split()[0].split("=")[1]), out


def test_the_caches_kept_between_steps_are_reported_apart_from_a_steps_peak(capsys):
    """V 65,536, H 256, Markov rank 256, bf16: the chunked path's joined [lm_head | W2] head is
    65,536 x 512 x 2 bytes = 64 MiB (0.0625 GiB), built by the warm-up block and kept."""
    kept, added, out = chunked_figures(capsys, "--vocab", "65536", "--hidden", "256", "--anchors", "8",
                                       "--markov-rank", "256", "--chunk-blocks", "2")
    assert kept >= 0.06, out
    assert added > 0, out  # the step's own: its chunks' work and W2's fp32 gradient (64 MiB here)
