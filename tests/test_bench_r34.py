"""Review round 34 of the benchmarks' measurement honesty (bench_train, bench_objective,
bench_split, bench_target)."""

from __future__ import annotations

import torch
from trainer_helpers import tiny_model_config

from draftforge.train import bench_objective as bo
from draftforge.train import bench_train as bt
from draftforge.train.blocks import dense_block_mask


def _touch(nbytes: int) -> bytearray:
    buf = bytearray(nbytes)
    for i in range(0, nbytes, 4096):
        buf[i] = 1
    return buf


def test_the_objective_peak_is_the_childs_own_not_the_parents(capsys):
    """ru_maxrss of a freshly exec'd child holds the peak resident memory of the process that
    started it: from a parent that once held 1.5 GiB, a tiny objective read ~1 GiB "added"."""
    buf = _touch(1536 * 2**20)  # this process's peak: at least 1.5 GiB
    del buf
    assert bo.main(["--vocab", "4096", "--hidden", "128", "--anchors", "8", "--markov-rank", "8",
                    "--chunk-blocks", "2", "--threads", "1", "--paths", "chunked"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    chunked = float(last.split()[0].split("=")[1])
    # a 4096 x 128 vocabulary over 64 slots: well under 0.1 GiB added, whatever the parent held
    assert 0 <= chunked < 0.2, last


def test_the_peak_reader_reads_this_processes_own_high_water_mark():
    """VmHWM after a reset follows this process's allocations (an independent check of the
    reader: a touched 256 MiB buffer raises it by about that much)."""
    bo._reset_peak_rss()
    before = bo._rss_bytes()
    buf = _touch(256 * 2**20)
    del buf
    added = bo._peak_rss_bytes() - before
    assert 200 * 2**20 < added < 400 * 2**20


def test_the_attention_count_is_the_keys_the_block_mask_lets_each_query_see():
    """The edge torch's FLOP counter misses (CPU SDPA is not counted): the attention count
    equals QK^T and PV over the True entries of the trainer's own block mask, anchors at the
    start, the middle and the end of the sequence, two sequences."""
    cfg = tiny_model_config(head_dim=16)  # 4 heads of 16: q width 64, not the hidden 32
    anchors = [[0, 7, 29], [3, 15, 30]]
    mask = dense_block_mask(torch.tensor(anchors), 32, cfg.block_size)
    visible = int(mask.sum())
    expected = cfg.num_hidden_layers * 2 * 2 * cfg.num_attention_heads * cfg.head_dim * visible
    assert bt.step_flops(cfg, seq=32, anchors=anchors)["attention"] == expected
