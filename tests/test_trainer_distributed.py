"""The trainer across processes (gloo on CPU): FSDP2 equals one process on the union of the data,
exact resume on a trainer subgroup, DeepSpeed ZeRO-2/3 train."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from splitserve_helpers import free_port
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.train.export import export_draft, load_training_checkpoint
from draftforge.train.hf_load import load_exported_draft
from draftforge.train.sample import pack
from draftforge.train.trainer import Trainer

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("trainer_worker.py")
NUM_SAMPLES, BUDGET = 48, 80
# 40 anchors cover every candidate of a <= 40-token sample: anchors do not depend on the
# rank layout, so one process can reproduce a multi-process step exactly.
ALL_ANCHORS = 40


def launch(tmp_path: Path, name: str, *, world: int, trainer_ranks: list[int], train: dict,
           timeout: float = 150, **job) -> dict:
    """Run the worker on ``world`` processes; returns trainer rank 0's output."""
    out = tmp_path / f"{name}.json"
    job = dict(trainer_ranks=trainer_ranks, train=train, run_dir=str(tmp_path / job.pop("run", name)),
               num_samples=NUM_SAMPLES, token_budget=BUDGET, out=str(out), **job)
    job_path = tmp_path / f"{name}.job.json"
    job_path.write_text(json.dumps(job))
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(job_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    codes = [p.returncode for p in procs]
    if codes != [0] * world:  # each rank's own lines, without torch's deprecation chatter
        shown = ["\n".join(line for line in log.splitlines()
                           if "FutureWarning" not in line and "return func(*args" not in line)[-3000:]
                 for log in logs]
        raise AssertionError(f"exit codes {codes}\n" + "\n".join(
            f"--- rank {rank} ---\n{text}" for rank, text in enumerate(shown)))
    result = json.loads(out.read_text())
    weights = Path(str(out) + ".safetensors")
    result["state"] = load_file(str(weights)) if weights.exists() else None
    return result


def _single_on_union(tmp_path: Path, train: dict, num_trainers: int, *, nan_ids: tuple[int, ...] = ()):
    """One process, each step on the union of what the trainers saw at that step."""
    batches = pack(chain_samples(NUM_SAMPLES, nan_ids=nan_ids), BUDGET)
    merged = [sum(batches[i:i + num_trainers], []) for i in range(0, len(batches), num_trainers)]
    merged = [m for m in merged if len(m) > 0]
    records = []
    trainer = Trainer(model_config=tiny_model_config(), train=train_config(**train),
                      embeddings=target_embeddings(), run_dir=tmp_path / "single")
    trainer.fit(merged, on_step=records.append)
    return records, trainer.full_state_dict()


def _assert_same_run(multi: dict, records: list[dict], state, *, rtol: float, atol: float):
    # Same samples per step (the order inside a step differs: rank-major vs micro-step-major).
    assert [sorted(ids) for ids in multi["sample_ids"]] == [sorted(r["sample_ids"]) for r in records]
    torch.testing.assert_close(torch.tensor(multi["losses"]), torch.tensor([r["loss"] for r in records]),
                               rtol=rtol, atol=atol)
    torch.testing.assert_close(torch.tensor(multi["grad_norms"]),
                               torch.tensor([r["grad_norm"] for r in records]), rtol=rtol, atol=atol)
    for name, value in state.items():
        torch.testing.assert_close(multi["state"][name].float(), value.float(), rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_fsdp2_two_trainers_equal_one_process_on_the_union(tmp_path):
    train = dict(strategy="fsdp2", dtype="float32", steps=5, num_anchors=ALL_ANCHORS)
    multi = launch(tmp_path, "fsdp2", world=2, trainer_ranks=[0, 1], train=train)
    records, state = _single_on_union(tmp_path, dict(train, strategy="single"), 2)
    assert len(multi["losses"]) == 5
    _assert_same_run(multi, records, state, rtol=2e-5, atol=2e-6)
    # The gradient was not trivially small: the weights moved.
    init = Trainer(model_config=tiny_model_config(), train=train_config(steps=1),
                   embeddings=target_embeddings(), run_dir=tmp_path / "init").full_state_dict()
    assert (state["fc.weight"] - init["fc.weight"]).abs().max() > 1e-3
    _assert_exportable(tmp_path / "fsdp2", multi["state"], tmp_path / "fsdp2-export")


def _assert_exportable(run_dir: Path, final_state: dict, out: Path) -> None:
    """The newest checkpoint of a sharded run holds the gathered weights, exactly, and exports."""
    cfg, saved = load_training_checkpoint(run_dir)
    assert cfg == tiny_model_config()
    assert sorted(saved) == sorted(final_state)
    for name, value in final_state.items():
        assert torch.equal(saved[name], value), name
    export_draft((saved, cfg), out, with_embeddings=True)
    loaded = load_exported_draft(out).state_dict()
    assert sorted(loaded) == sorted(saved)
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name


def test_fsdp2_resume_on_a_trainer_subgroup_is_exact(tmp_path):
    # World of 3: rank 0 stands in for a target rank, ranks 1 and 2 train (bf16 parameters).
    train = dict(strategy="fsdp2", dtype="bfloat16", steps=6, checkpoint_interval=2, keep_last=3)
    full = launch(tmp_path, "full", world=3, trainer_ranks=[1, 2], train=train)
    launch(tmp_path, "cut", world=3, trainer_ranks=[1, 2], train=train, crash_at=3)
    rest = launch(tmp_path, "rest", world=3, trainer_ranks=[1, 2], run="cut",
                  train=dict(train, resume="auto"))
    assert rest["resumed_step"] == 2 and rest["resumed_extra"] == {"rank": 0}
    assert rest["steps"] == [3, 4, 5, 6]
    assert rest["sample_ids"] == full["sample_ids"][2:]
    assert rest["losses"] == full["losses"][2:]
    for name, value in full["state"].items():
        assert torch.equal(rest["state"][name], value), name
    # No sample seen twice, none lost, across the interruption.
    seen = [i for ids in full["sample_ids"] for i in ids]
    assert len(seen) == len(set(seen))


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed==0.19.8)")
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_trains_like_one_process(tmp_path, stage):
    train = dict(strategy="deepspeed", zero_stage=stage, dtype="float32", steps=4,
                 num_anchors=ALL_ANCHORS, grad_accum=2, checkpoint_interval=2)
    multi = launch(tmp_path, f"zero{stage}", world=2, trainer_ranks=[0, 1], train=train, timeout=240)
    records, state = _single_on_union(tmp_path, dict(train, strategy="single"), 2)
    _assert_same_run(multi, records, state, rtol=1e-4, atol=1e-5)
    assert (tmp_path / f"zero{stage}" / "checkpoints" / "step_00000004" / "COMPLETE").is_file()
    _assert_exportable(tmp_path / f"zero{stage}", multi["state"], tmp_path / f"zero{stage}-export")
    # Resume from step 2 (DeepSpeed's own files, read back with weights_only=True).
    step2 = tmp_path / f"zero{stage}" / "checkpoints" / "step_00000002"
    rest = launch(tmp_path, f"zero{stage}-rest", world=2, trainer_ranks=[0, 1],
                  train=dict(train, resume=str(step2)), timeout=240)
    assert rest["resumed_step"] == 2 and rest["sample_ids"] == multi["sample_ids"][2:]
    assert rest["losses"] == multi["losses"][2:]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed==0.19.8)")
def test_deepspeed_skips_a_step_where_one_rank_saw_a_non_finite_loss(tmp_path):
    """A NaN feature in one rank's batch skips that step on both ranks and leaves the weights
    finite; the other steps train."""
    train = dict(strategy="deepspeed", zero_stage=2, dtype="float32", steps=4, num_anchors=ALL_ANCHORS,
                 max_bad_steps=3)
    batches = pack(chain_samples(NUM_SAMPLES), BUDGET)
    poisoned = batches[2][0].sample_id  # rank 0's second batch: step 2
    out = launch(tmp_path, "ds-nan", world=2, trainer_ranks=[0, 1], train=train, timeout=240,
                 nan_ids=[int(poisoned[1:])])
    assert out["steps"] == [1, 2, 3, 4] and out["skipped"] == [False, True, False, False]
    losses = torch.tensor(out["losses"])
    assert losses[1].isnan() and losses[[0, 2, 3]].isfinite().all()
    state = load_file(str(tmp_path / "ds-nan.json") + ".safetensors")
    assert all(torch.isfinite(v).all() for v in state.values())


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed==0.19.8)")
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_with_accumulation_skips_only_the_step_with_a_non_finite_loss(tmp_path, stage):
    """grad_accum 2, a NaN feature in rank 0's second micro-batch of step 2: that step is skipped
    and counted, the run goes on and ends with a checkpoint (it used to stop with a RuntimeError,
    and a resume met the same sample again), and the other steps equal one process on the union,
    which skips the same step: nothing of the bad step leaks into the next one (ZeRO-3 used to
    accumulate step 3 onto its NaN gradient and skip that step too)."""
    from draftforge.train import checkpoint as ckpt

    train = dict(strategy="deepspeed", zero_stage=stage, dtype="float32", steps=4,
                 num_anchors=ALL_ANCHORS, grad_accum=2, max_bad_steps=3)
    poisoned = pack(chain_samples(NUM_SAMPLES), BUDGET)[6][0].sample_id  # rank 0, step 2, micro 2
    nan_ids = (int(poisoned[1:]),)
    multi = launch(tmp_path, f"zero{stage}-nan", world=2, trainer_ranks=[0, 1], train=train,
                   timeout=240, nan_ids=list(nan_ids))
    records, state = _single_on_union(tmp_path, dict(train, strategy="single"), 2, nan_ids=nan_ids)
    assert multi["skipped"] == [False, True, False, False] == [r["skipped"] for r in records]
    assert multi["stopped_reason"] == "steps_done" and multi["steps"] == [1, 2, 3, 4]
    assert math.isnan(multi["losses"][1]) and poisoned in multi["sample_ids"][1]
    good = [0, 2, 3]
    torch.testing.assert_close(torch.tensor([multi["losses"][i] for i in good]),
                               torch.tensor([records[i]["loss"] for i in good]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor([multi["grad_norms"][i] for i in good]),
                               torch.tensor([records[i]["grad_norm"] for i in good]), rtol=1e-4, atol=1e-5)
    for name, value in state.items():
        torch.testing.assert_close(multi["state"][name].float(), value.float(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    final = tmp_path / f"zero{stage}-nan" / "checkpoints" / "step_00000004"
    assert ckpt.read_checked_state(final)["skipped_steps"] == 1


def test_fsdp2_resume_refuses_metadata_that_would_run_code(tmp_path):
    """A crafted .metadata in an FSDP2 checkpoint: the resume stops with the file named and
    the payload (creating a folder) never runs; DCP alone would unpickle it."""
    import pickle

    train = dict(strategy="fsdp2", dtype="float32", steps=4, checkpoint_interval=2, keep_last=3)
    launch(tmp_path, "cut", world=2, trainer_ranks=[0, 1], train=train, crash_at=3)
    newest = sorted((tmp_path / "cut" / "checkpoints").glob("step_*"))[-1]
    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (os.makedirs, (str(marker),))

    (newest / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(AssertionError) as info:
        launch(tmp_path, "again", world=2, trainer_ranks=[0, 1], run="cut",
               train=dict(train, resume="auto"), timeout=100)
    assert f"checkpoint file {newest / 'dcp' / '.metadata'} is not DCP metadata" in str(info.value)
    assert "refusing to unpickle it" in str(info.value)
    assert not marker.exists()

