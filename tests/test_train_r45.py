"""Review round 45 of the training loop: D-PACE weights with accumulation refused by the trainer
itself (a library caller's TrainConfig bypasses the recipe's check and trained on a loss about
grad_accum times the step's), and a sample without tokens refused before it trains (it trained,
and then every checkpoint holding it was refused as corrupt)."""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import (
    chain_samples,
    gather_strings_worker,
    target_embeddings,
    tiny_model_config,
    train_config,
)

from draftforge.errors import InputError
from draftforge.train import checkpoint as ckpt
from draftforge.train.config import LossConfig
from draftforge.train.sample import Sample
from draftforge.train.trainer import Trainer


def _trainer(run_dir, **overrides) -> Trainer:
    return Trainer(model_config=tiny_model_config(), train=train_config(**overrides),
                   embeddings=target_embeddings(), run_dir=run_dir)


def test_dpace_with_accumulation_is_refused_by_the_trainer(tmp_path):
    """Unrefused, grad_accum=2 over [short], [long] logged a loss about twice the one of a
    step on [short + long] (each micro-batch divided by its own weight sum, then summed)."""
    dpace = LossConfig(position_weighting="dpace")
    with pytest.raises(InputError) as info:
        _trainer(tmp_path / "two", loss=dpace, grad_accum=2)
    message = str(info.value)
    assert "train.grad_accum=2" in message and "position_weighting=dpace" in message
    # one micro-batch a step, and exp weights with accumulation, still train
    short = chain_samples(1, seed=1, min_len=8, max_len=8)
    record = _trainer(tmp_path / "one", loss=dpace, num_anchors=200).train_step([short])
    assert torch.isfinite(torch.tensor(record["loss"]))
    _trainer(tmp_path / "exp", grad_accum=2)


def _empty(like: Sample) -> Sample:
    return Sample("empty-1", like.input_ids[:0], like.loss_mask[:0], like.aux[:0], like.final[:0])


def test_a_sample_without_tokens_is_refused_before_the_step(tmp_path):
    """Beside other samples it used to train, and the checkpoint recorded its 0 tokens, which
    resume then refused as a corrupt trainer_state.json (advising to delete the checkpoint);
    alone in a micro-batch it failed with an IndexError deep in the draft."""
    samples = chain_samples(4)
    trainer = _trainer(tmp_path, steps=2, grad_accum=2)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    for micro in ([[samples[0]], [samples[1], _empty(samples[0])]], [[_empty(samples[0])], [samples[1]]]):
        with pytest.raises(InputError, match=r"sample 'empty-1' \(micro-batch \d of step 1\) has no tokens"):
            trainer.train_step(micro)
    assert trainer.step == 0 and trainer.consumed_ids == []
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, before[name]), name
    # the run goes on with its other samples, and its checkpoint resumes
    result = trainer.fit([[samples[0]], [samples[1]], [samples[2]], [samples[3]]])
    assert result.step == 2 and result.checkpoint == ckpt.checkpoint_path(tmp_path, 2)
    again = _trainer(tmp_path, steps=3, resume="auto")
    assert again.resume().consumed_ids == [s.sample_id for s in samples]


def test_strings_gathered_and_broadcast_over_gloo_arrive_as_sent(tmp_path):
    """Every rank's consumed sample ids reach every rank (a checkpoint's data cursor), text
    outside ASCII and empty lists included; decoded through numpy's bytes since round 45."""
    import json

    import torch.multiprocessing as mp

    out = str(tmp_path / "result")
    mp.spawn(gather_strings_worker, args=(2, f"file://{tmp_path / 'store'}", out), nprocs=2, join=True)
    expected = [[], ["r1-é-0", "r1-é-1", "r1-é-2", "日本", ""]]
    for rank in range(2):
        result = json.loads((tmp_path / f"result.{rank}").read_text(encoding="utf-8"))
        assert result == {"gathered": expected, "told": "from one: ∑"}


def test_fit_without_resume_in_a_folder_holding_another_runs_checkpoints_is_refused(tmp_path):
    """A library caller who forgot resume(): the new run saved below the old run's checkpoints
    and pruning to keep_last deleted the old run's as they aged out; the job itself calls
    resume(), which refused such a start already."""
    samples = chain_samples(6)
    first = _trainer(tmp_path, steps=3, checkpoint_interval=1, keep_last=3)
    assert first.fit([[s] for s in samples[:3]]).step == 3
    saved = sorted(p.name for p in ckpt.complete_checkpoints(tmp_path))
    second = _trainer(tmp_path, steps=3, checkpoint_interval=1, keep_last=3)
    with pytest.raises(ckpt.CheckpointError, match=r"already holds checkpoints.*call Trainer\.resume\(\) before fit\(\)"):
        second.fit([[s] for s in samples[3:]])
    assert sorted(p.name for p in ckpt.complete_checkpoints(tmp_path)) == saved
    # resumed, it continues that run; a fit() after a fit() of the same trainer is no fresh start
    third = _trainer(tmp_path, steps=5, checkpoint_interval=1, keep_last=3, resume="auto")
    assert third.resume().step == 3
    assert third.fit([[s] for s in samples[3:5]]).step == 5
    fourth = _trainer(tmp_path / "other", steps=1)
    fourth.fit([[samples[0]]])
    fourth.train = fourth.train.model_copy(update={"steps": 2})
    assert fourth.fit([[samples[1]]]).step == 2


def _fsdp2_checkpoint(run_dir):
    """An fsdp2-layout checkpoint of a small AdamW-trained module (one process, no group)."""
    import warnings

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4, generator=torch.Generator().manual_seed(0))).sum().backward()
    optimizer.step()
    state = {"step": 2, "skipped_steps": 0, "strategy": "fsdp2", "consumed_ids": [["a"]]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        return ckpt.save_checkpoint(run_dir=run_dir, step=2, strategy="fsdp2", model=model,
                                    optimizer=optimizer, engine=None, state=state, group=None, keep_last=2)


@pytest.mark.parametrize("failure", ["plain", "collected"])
def test_a_trainer_lost_during_a_resumes_load_is_a_lost_peer_not_a_corrupt_checkpoint(tmp_path, monkeypatch, failure):
    """Another trainer dying inside DCP's load made the survivor call a whole checkpoint corrupt:
    exit status 2 (no restart) and the advice to delete it. It is raised as the collective's
    RuntimeError now, which the rank reports as a lost peer (exit 3, resumable)."""
    import traceback
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from draftforge.train import distributed as D

    path = _fsdp2_checkpoint(tmp_path)
    lost = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                        "[127.0.0.1]:10146")

    def load(*args, **kwargs):
        # DCP collects each rank's failure with its stack: rank 1's collective lost rank 0
        raise lost if failure == "plain" else CheckpointException("load", {1: (lost, traceback.StackSummary())})

    monkeypatch.setattr(dcp, "load", load)
    model = torch.nn.Linear(4, 3)
    with warnings.catch_warnings(), pytest.raises(RuntimeError) as raised:
        warnings.simplefilter("ignore")
        ckpt.load_checkpoint(path=path, strategy="fsdp2", model=model,
                             optimizer=torch.optim.AdamW(model.parameters()), engine=None, group=None)
    assert not isinstance(raised.value, ckpt.CheckpointError) and D.lost_peer(raised.value)
    # any other failure of the load still names the checkpoint as corrupt
    monkeypatch.setattr(dcp, "load", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bad storage")))
    with warnings.catch_warnings(), pytest.raises(ckpt.CheckpointError, match="corrupt"):
        warnings.simplefilter("ignore")
        ckpt.load_checkpoint(path=path, strategy="fsdp2", model=model,
                             optimizer=torch.optim.AdamW(model.parameters()), engine=None, group=None)
