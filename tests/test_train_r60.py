"""Trainer ranks fed unevenly at the end of the data: a rank short of micro-batches joins the
step with micro-batches that supervise nothing, so the better-fed ranks' samples still train.

Several target ranks feed the trainers unevenly (each producer balances only its own samples:
tests/test_balance_r60.py measures it); a step only where every trainer rank was full left the
excess of the better-fed ranks untrained. Run as a script, this file is one rank of the
two-rank tests below (gloo).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from test_train_r22 import ALL_ANCHORS, CLIP, _assert_same_records, _assert_same_weights, _trainer
from trainer_helpers import (
    chain_samples,
    run_script_ranks,
    target_embeddings,
    tiny_model_config,
    train_config,
)

from draftforge.errors import InputError
from draftforge.train.sample import Sample
from draftforge.train.trainer import Trainer

# Micro-batch sizes (samples) each rank receives, in order, at grad_accum 2: rank 1 runs dry
# after the first step, rank 0 has a second full step and one micro-batch left over.
RANK_STREAMS = ((1, 2, 1, 2, 1), (2, 1))


def _streams() -> list[list[list[str]]]:
    ids = iter(s.sample_id for s in chain_samples(sum(map(sum, RANK_STREAMS))))
    return [[[next(ids) for _ in range(size)] for size in sizes] for sizes in RANK_STREAMS]


def _worker(job_path: str) -> None:
    import torch.distributed as dist

    job = json.loads(Path(job_path).read_text())
    if job["train"]["strategy"] == "deepspeed":
        os.environ["LOCAL_RANK"] = os.environ["RANK"]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    by_id = {s.sample_id: s for s in chain_samples(sum(map(sum, RANK_STREAMS)))}
    trainer = Trainer(model_config=tiny_model_config(), train=train_config(**job["train"]),
                      embeddings=target_embeddings(), run_dir=Path(job["run_dir"]), group=dist.group.WORLD)
    records: list[dict] = []
    stream = [[by_id[i] for i in micro] for micro in _streams()[rank]]
    if job.get("empty_on") == rank:  # a sample without tokens in this rank's first micro-batch
        first = stream[0][0]
        stream[0][0] = Sample("empty", first.input_ids[:0], first.loss_mask[:0], first.aux[:0], first.final[:0])
    if "empty_on" in job:
        try:
            trainer.fit(stream, on_step=records.append)
        except InputError as err:
            Path(f"{job['out']}.{rank}").write_text(json.dumps({"refused": str(err), "records": records}))
        dist.destroy_process_group()
        return
    result = trainer.fit(stream, on_step=records.append)
    state = trainer.full_state_dict()
    Path(f"{job['out']}.{rank}").write_text(json.dumps({
        "records": records, "stopped": result.stopped_reason, "untrained": result.untrained,
        "consumed": trainer.consumed_ids}))
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, job["out"] + ".safetensors")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["fsdp2", "deepspeed"])
def test_a_rank_that_ran_dry_fills_the_step_and_the_others_samples_train(tmp_path, strategy):
    """Rank 0 has two full steps, rank 1 one: both steps run (the second equal to one process's
    batch of rank 0's two micro-batches, every logged figure and the weights, the clip active),
    rank 1's filler adds no sample, token or supervised slot, and only the micro-batch that no
    rank could complete a step with is left untrained."""
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed")
    from safetensors.torch import load_file

    train = dict(strategy=strategy, dtype="float32", steps=10, num_anchors=ALL_ANCHORS, grad_accum=2,
                 max_grad_norm=CLIP, checkpoint_interval=100)
    out = tmp_path / "multi"
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"train": train, "run_dir": str(tmp_path / "multi"), "out": str(out)}))
    run_script_ranks(__file__, job)
    ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    streams = _streams()
    for got in ranks:
        assert got["stopped"] == "data_exhausted" and got["untrained"] == 1, got
        assert len(got["records"]) == 2
    # each rank consumed what it trained: rank 0 four micro-batches, rank 1 its two; no filler
    assert ranks[0]["consumed"] == [i for micro in streams[0][:4] for i in micro]
    assert ranks[1]["consumed"] == [i for micro in streams[1] for i in micro]

    by_id = {s.sample_id: s for s in chain_samples(sum(map(sum, RANK_STREAMS)))}
    whole = [streams[0][0] + streams[0][1] + streams[1][0] + streams[1][1], streams[0][2] + streams[0][3]]
    records: list[dict] = []
    one = _trainer(tmp_path / "one", **dict(train, strategy="single", grad_accum=1))
    one.fit([[by_id[i] for i in step] for step in whole], on_step=records.append)
    assert all(r["grad_norm"] > 10 * CLIP for r in records)  # clipping did act
    _assert_same_records(ranks[0]["records"], records)
    _assert_same_weights(load_file(str(out) + ".safetensors"), one.full_state_dict())


@pytest.mark.distributed
def test_a_sample_without_tokens_on_one_rank_is_refused_on_every_rank(tmp_path):
    """Refused before the step's collectives on every rank: the rank holding it names it, the
    others say another rank holds one (only the holder raising left the others waiting in the
    step's reductions, found by review round 61)."""
    train = dict(strategy="fsdp2", dtype="float32", steps=10, num_anchors=ALL_ANCHORS, grad_accum=2,
                 checkpoint_interval=100)
    out = tmp_path / "multi"
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"train": train, "run_dir": str(out), "out": str(out), "empty_on": 1}))
    run_script_ranks(__file__, job, timeout=120)
    ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    assert [r["records"] for r in ranks] == [[], []]
    assert ranks[1]["refused"].startswith("sample 'empty' (micro-batch 0 of step 1) has no tokens")
    assert ranks[0]["refused"] == ("step 1: another trainer rank holds a sample without tokens, which "
                                   "cannot be trained (that rank names it)")


def test_an_empty_sample_in_a_last_step_no_rank_can_fill_stops_as_data_exhausted(tmp_path):
    """That step trains nothing, so it refuses nothing either: the run ends as before, its last
    full step checkpointed."""
    samples = chain_samples(3)
    first = samples[0]
    empty = Sample("empty", first.input_ids[:0], first.loss_mask[:0], first.aux[:0], first.final[:0])
    trainer = _trainer(tmp_path, steps=10, grad_accum=2)
    result = trainer.fit([samples[0:1], samples[1:2], [empty]])
    assert (result.steps_run, result.stopped_reason, result.untrained) == (1, "data_exhausted", 1)


def test_a_single_rank_still_stops_at_a_step_it_cannot_fill(tmp_path):
    """With one rank nothing is filled: a last partial step stays untrained, as before."""
    samples = chain_samples(5)
    trainer = _trainer(tmp_path, steps=10, grad_accum=2)
    result = trainer.fit([samples[0:2], samples[2:3], samples[3:5]])
    assert (result.steps_run, result.stopped_reason, result.untrained) == (1, "data_exhausted", 2)


def test_the_filler_supervises_nothing():
    trainer = Trainer(model_config=tiny_model_config(), train=train_config(), embeddings=target_embeddings(),
                      run_dir="unused")
    filler = trainer._filler_sample()
    assert not filler.loss_mask.any() and filler.num_tokens == tiny_model_config().block_size + 1
    assert filler.aux.shape[1] == tiny_model_config().num_context_features
    assert not filler.aux.any() and not filler.final.any()


if __name__ == "__main__":
    torch.set_num_threads(1)
    _worker(sys.argv[1])
    from trainer_helpers import leave_at_once

    leave_at_once()
