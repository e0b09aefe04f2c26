"""bench objective's chunked peak counted, on a CPU, W2's gradient group buffer, which the
objective keeps between steps (a training's first step makes it; the warm-up block was too
small to), as the step's own (session 53: 0.06 of a 0.08 GiB peak)."""

from test_bench_r48 import chunked_figures


def test_the_w2_group_buffer_is_kept_between_steps_not_a_steps_peak(capsys):
    """V 32,768, Markov rank 64, 128 blocks of 8, bf16: the step's 1,024 rows fit one group, so
    the buffer is 1,024 x 32,768 x 2 bytes = 64 MiB (0.0625 GiB); the joined [lm_head | W2]
    head adds 32,768 x 320 x 2 bytes = 20 MiB."""
    kept, added, out = chunked_figures(capsys, "--vocab", "32768", "--hidden", "256", "--anchors", "128",
                                       "--markov-rank", "64", "--chunk-blocks", "4")
    assert kept >= 0.08, out
    assert added < 0.0625, out  # the buffer alone would be 0.0625
