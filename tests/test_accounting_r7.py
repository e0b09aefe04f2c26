"""Review round 7 of the accounting, the metrics log and bench split."""

from __future__ import annotations

import math
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from draftforge.errors import InputError


def test_the_trainers_shares_and_rate_end_at_its_last_step(monkeypatch):
    """One step at t = 1..4 s (1 s waiting, 3 s computing, 100 tokens), then the final
    checkpoint and the stream's drain until t = 24 s: the trainer was busy 3 of 4 s and
    idle 1 of 4 at 25 tokens/s. Counting the 20 s after the step read busy 12.5 % at 4 tok/s."""
    from draftforge.splitserve import accounting as A

    clock = [0.0]
    monkeypatch.setattr(A, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    acc = A.ConsumerAccounting(world=2, num_target=1, credits=4)
    clock[0] = 1.0
    acc.on_take(depth=1, tokens=100, waited_s=1.0)
    clock[0] = 4.0
    acc.on_step({"compute_s": 3.0, "wait_s": 1.0})
    interval = acc.line()
    clock[0] = 24.0  # the final save and stream.stop()
    consumer = acc.snapshot()["consumer"]
    assert (consumer["wall_s"], consumer["busy_share"], consumer["idle_share"]) == (4.0, 0.75, 0.25)
    assert consumer["rate_tok_s"] == 25.0 and consumer["capacity_tok_s"] == pytest.approx(100 / 3)
    assert "trainer busy 75% idle 25% 25 tok/s" in interval
    assert "trainer (this rank): busy 75.0%  idle 25.0%  100 tokens  25 tok/s" in acc.summary_text()


def test_wandb_and_tensorboard_get_the_per_slot_acceptance(tmp_path, monkeypatch):
    """The per-slot mean c*_k (a list in the record) reaches wandb and TensorBoard as one
    scalar a slot; a slot with no supervised position (NaN, null in the JSONL) is left out.
    Only the record's plain numbers used to go, so c*_k was in metrics.jsonl alone."""
    from draftforge.train.metrics import MetricsLog

    logged, scalars = [], []

    class Run:
        def log(self, data, step):
            logged.append((step, data))

        def finish(self):
            pass

    class SummaryWriter:
        def __init__(self, log_dir, purge_step=None):
            pass

        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

        def close(self):
            pass

    fake_wandb = types.ModuleType("wandb")
    fake_wandb.init = lambda **kwargs: Run()
    fake_tb = types.ModuleType("torch.utils.tensorboard")
    fake_tb.SummaryWriter = SummaryWriter
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake_tb)
    train = SimpleNamespace(wandb=True, wandb_mode="offline", tensorboard=True)
    log = MetricsLog(tmp_path, train=train, recipe_yaml=None)
    log.log({"step": 3, "loss": 1.5, "tau": 2.0, "slot_acceptance": [0.9, math.nan, 0.25],
             "sample_ids": ["a", "b"]})
    log.close()
    (step, data), = logged
    assert step == 3
    assert {k: v for k, v in data.items() if k.startswith("slot_acceptance")} == {
        "slot_acceptance/0": 0.9, "slot_acceptance/2": 0.25}
    assert ("train/slot_acceptance/0", 0.9, 3) in scalars and ("train/slot_acceptance/2", 0.25, 3) in scalars
    assert not any(tag == "train/slot_acceptance/1" for tag, _, _ in scalars)


def test_a_trainer_given_no_sample_in_phase_1_says_what_to_do(monkeypatch):
    """A bench split trainer that phase 1 gave no sample (its producer's samples all went to
    other trainers before split.max_epochs ended the data) stops with an InputError naming the
    rank and its producers (the launcher prints it without a traceback, status 2); it was a
    RuntimeError, printed with a traceback as if draftforge had failed."""
    from draftforge.splitserve import bench_split
    from draftforge.splitserve import transport as T

    monkeypatch.setattr(T, "recv_tensor", lambda *args, **kwargs: torch.tensor([0, 0]))
    monkeypatch.setattr(T, "recv_sample", lambda *args, **kwargs: None)  # END at once
    ctx = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(grad_accum=1)), rank=2,
                          topology=SimpleNamespace(sources=lambda rank: [0], dests=lambda src: [1, 2]),
                          data_group=None, device="cpu", log=print)
    with pytest.raises(InputError) as err:
        bench_split.bench_trainer_rank(ctx, None, {"steps": 2}, acks=SimpleNamespace(hello=lambda ids: None))
    assert str(err.value) == (
        "bench split: trainer rank 2 received no sample in phase 1 from target rank(s) [0]; add "
        "data (data.num_samples) or drop split.max_epochs")
