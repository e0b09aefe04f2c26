"""Review round 22 of the trainer: the schedule against a hand-derived one, accumulation and
trainer ranks against one batch (every metric, with clipping active), the optimizer's
parameters, and the plot title of a run whose last steps measured no tau.

Run as a script, this file is one rank of the two-rank test below (gloo).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from trainer_helpers import (
    chain_samples,
    run_script_ranks,
    target_embeddings,
    tiny_model_config,
    train_config,
)

from draftforge.train.config import warmup_steps
from draftforge.train.trainer import Trainer, lr_at

# Every candidate position of a <= 40-token sample is an anchor: anchors do not depend on
# how the samples are split, so the split and the whole batch see the same blocks.
ALL_ANCHORS = 40
# Far below the test problem's gradient norm (~1.3): every step is clipped.
CLIP = 0.05
METRICS = ("loss", "ce", "tv", "bce", "kl", "tau", "grad_norm", "lr")


def _hand_lr(step: int, *, lr: float, steps: int, warmup: int, floor: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / (steps - warmup)
    return lr * (floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2)


@pytest.mark.parametrize("steps,ratio,floor", [(100, 0.1, 0.1), (360, 0.04, 0.0), (7, 0.0, 0.25), (50, 0.3, 1.0)])
def test_the_schedule_is_the_hand_derived_warmup_then_cosine(steps, ratio, floor):
    """Step 0 gets lr / warmup (never 0), the last warmup step the peak, then a cosine over the
    remaining steps towards min_lr_ratio * lr; a pure function of the step, so a resumed run
    gets the rate an uninterrupted one would."""
    train = train_config(steps=steps, lr=2.0, warmup_ratio=ratio, min_lr_ratio=floor)
    warmup = warmup_steps(train)
    assert warmup == math.ceil(round(ratio * steps, 9))
    rates = [lr_at(s, train=train) for s in range(steps)]
    for step, rate in enumerate(rates):
        assert rate == pytest.approx(_hand_lr(step, lr=2.0, steps=steps, warmup=warmup, floor=floor)), step
    assert rates[0] > 0
    if warmup:
        assert rates[0] == pytest.approx(2.0 / warmup) and rates[warmup - 1] == pytest.approx(2.0)
    assert all(rate >= 2.0 * floor - 1e-12 for rate in rates[warmup:])
    assert all(a >= b - 1e-12 for a, b in zip(rates[warmup:], rates[warmup + 1:], strict=False))


def _trainer(tmp_path: Path, **overrides) -> Trainer:
    return Trainer(model_config=tiny_model_config(), train=train_config(**overrides),
                   embeddings=target_embeddings(), run_dir=tmp_path)


def _assert_same_records(split: list[dict], whole: list[dict]) -> None:
    assert len(split) == len(whole)
    for a, b in zip(split, whole, strict=True):
        assert sorted(a["sample_ids"]) == sorted(b["sample_ids"])
        assert (a["tokens"], a["block_tokens"]) == (b["tokens"], b["block_tokens"])
        for key in METRICS:
            assert a[key] == pytest.approx(b[key], rel=2e-5, abs=1e-7), key
        assert a["slot_acceptance"] == pytest.approx(b["slot_acceptance"], rel=2e-5)


def _assert_same_weights(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name, value in a.items():
        torch.testing.assert_close(value.float(), b[name].float(), rtol=1e-4, atol=2e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_uneven_micro_batches_with_clipping_equal_one_batch(tmp_path):
    """grad_accum=3 over micro-batches of 1, 4 and 2 samples is one step on the 7: every logged
    figure (the loss terms, tau, per-slot acceptance, tokens) and, with the clip active,
    the updated weights."""
    samples = chain_samples(14)
    micro = [samples[0:1], samples[1:5], samples[5:7], samples[7:8], samples[8:12], samples[12:14]]
    whole = [samples[0:7], samples[7:14]]
    split_records, whole_records = [], []
    split = _trainer(tmp_path / "split", steps=2, grad_accum=3, num_anchors=ALL_ANCHORS, max_grad_norm=CLIP)
    one = _trainer(tmp_path / "one", steps=2, num_anchors=ALL_ANCHORS, max_grad_norm=CLIP)
    split.fit(micro, on_step=split_records.append)
    one.fit(whole, on_step=whole_records.append)
    assert all(r["grad_norm"] > 10 * CLIP for r in whole_records)  # clipping did act
    _assert_same_records(split_records, whole_records)
    _assert_same_weights(split.full_state_dict(), one.full_state_dict())


def test_the_optimizer_holds_every_trainable_parameter_and_no_frozen_one(tmp_path):
    trainer = _trainer(tmp_path)
    held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    trainable = {id(p) for p in trainer.model.parameters() if p.requires_grad}
    frozen = {id(trainer.model.embed_tokens.weight), id(trainer.model.lm_head.weight)}
    assert held == trainable and not held & frozen
    assert sum(p.numel() for p in trainer.model.parameters() if id(p) in held) == trainer.num_trainable


def test_plot_title_leaves_out_a_tau_that_is_not_a_number():
    """The summary's tau is not a number when its last steps supervised nothing; the plot's
    title then shows no 'tau = nan'."""
    from draftforge.train.plots import acceptance_title

    assert acceptance_title([0.5, 0.5], float("nan")) == "per-slot acceptance (1 + sum of the line = 1.750)"
    assert acceptance_title([0.5, 0.5], 1.7) == "per-slot acceptance (tau = 1.700, 1 + sum of the line = 1.750)"


# --------------------------------------------------------------------------- two trainer ranks

# Per step, rank 0 gets micro-batches of 1 and 3 samples, rank 1 of 2 and 1: uneven in
# samples and tokens on purpose.
LAYOUT = ((1, 3), (2, 1))
NUM_STEPS = 2


def _rank_batches() -> tuple[list[list[list[str]]], list[list[str]]]:
    ids = iter(s.sample_id for s in chain_samples(NUM_STEPS * sum(map(sum, LAYOUT))))
    per_rank: list[list[list[str]]] = [[] for _ in LAYOUT]
    union = []
    for _ in range(NUM_STEPS):
        step = []
        for rank, sizes in enumerate(LAYOUT):
            for size in sizes:
                batch = [next(ids) for _ in range(size)]
                per_rank[rank].append(batch)
                step += batch
        union.append(step)
    return per_rank, union


def _worker(job_path: str) -> None:
    import torch.distributed as dist

    job = json.loads(Path(job_path).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    by_id = {s.sample_id: s for s in chain_samples(NUM_STEPS * sum(map(sum, LAYOUT)))}
    trainer = Trainer(model_config=tiny_model_config(), train=train_config(**job["train"]),
                      embeddings=target_embeddings(), run_dir=Path(job["run_dir"]), group=dist.group.WORLD)
    records: list[dict] = []
    trainer.fit([[by_id[i] for i in batch] for batch in _rank_batches()[0][rank]], on_step=records.append)
    state = trainer.full_state_dict()
    if rank == 0:
        from safetensors.torch import save_file

        Path(job["out"]).write_text(json.dumps(records))
        save_file({k: v.contiguous() for k, v in state.items()}, job["out"] + ".safetensors")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
def test_two_fsdp2_ranks_with_uneven_micro_batches_equal_one_batch(tmp_path):
    """Two trainer ranks x grad_accum=2, holding different numbers of samples and tokens, with
    the clip active: every logged figure and the weights equal one process's single batch."""
    from safetensors.torch import load_file

    train = dict(strategy="fsdp2", dtype="float32", steps=NUM_STEPS, num_anchors=ALL_ANCHORS,
                 grad_accum=2, max_grad_norm=CLIP)
    out = tmp_path / "multi.json"
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"train": train, "run_dir": str(tmp_path / "multi"), "out": str(out)}))
    run_script_ranks(__file__, job)
    multi = json.loads(out.read_text())

    by_id = {s.sample_id: s for s in chain_samples(NUM_STEPS * sum(map(sum, LAYOUT)))}
    records: list[dict] = []
    one = _trainer(tmp_path / "one", **dict(train, strategy="single", grad_accum=1))
    one.fit([[by_id[i] for i in step] for step in _rank_batches()[1]], on_step=records.append)
    assert all(r["grad_norm"] > 10 * CLIP for r in records)
    _assert_same_records(multi, records)
    _assert_same_weights(load_file(str(out) + ".safetensors"), one.full_state_dict())


if __name__ == "__main__":
    torch.set_num_threads(1)
    _worker(sys.argv[1])
    from trainer_helpers import leave_at_once

    leave_at_once()
