"""Checkpoint review, round 49: an fsdp2 checkpoint of an optimizer that has not stepped.

torch's ``get_state_dict`` gives an optimizer without state one by taking a zero-lr step
(AdamW's step count becomes 1), so the first real update after it would use step 2's bias
correction. One process, no group: the ``dcp/`` layout and code path of a sharded run.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from draftforge.train import checkpoint as ckpt


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.9, 0.999))


def _save(run_dir: Path, model, optimizer, step: int = 3) -> Path:
    state = {"step": step, "skipped_steps": step, "strategy": "fsdp2", "consumed_ids": [["a"]]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        return ckpt.save_checkpoint(run_dir=run_dir, step=step, strategy="fsdp2", model=model,
                                    optimizer=optimizer, engine=None, state=state, group=None,
                                    keep_last=2)


def _load(path: Path, model, optimizer) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ckpt.load_checkpoint(path=path, strategy="fsdp2", model=model, optimizer=optimizer,
                                    engine=None, group=None)


def _one_update(model, optimizer) -> torch.Tensor:
    """The weight change of one AdamW step on a fixed input."""
    before = model.weight.detach().clone()
    model(torch.arange(8.0).reshape(2, 4)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model.weight.detach() - before


def test_saving_before_the_first_step_leaves_the_optimizer_without_state(tmp_path):
    model, optimizer = _model_and_optimizer()
    path = _save(tmp_path, model, optimizer)
    assert not optimizer.state
    assert json.loads((path / ckpt.STATE_FILE).read_text())["optimizer_stepped"] is False
    # the first update is AdamW's first: lr * sign(g) where no weight decay acts (wd 0.01 x lr)
    fresh_model, fresh_optimizer = _model_and_optimizer()
    assert torch.allclose(_one_update(model, optimizer), _one_update(fresh_model, fresh_optimizer))


def test_a_resume_from_it_makes_the_same_first_update_as_a_fresh_optimizer(tmp_path):
    model, optimizer = _model_and_optimizer()
    path = _save(tmp_path, model, optimizer)
    resumed_model, resumed_optimizer = _model_and_optimizer()
    _load(path, resumed_model, resumed_optimizer)
    assert not resumed_optimizer.state
    update = _one_update(resumed_model, resumed_optimizer)
    expected = _one_update(*_model_and_optimizer())
    assert torch.allclose(update, expected)
    # AdamW's first step moves every weight by lr (times sign, plus decay), by hand
    assert torch.allclose(update.abs(), torch.full_like(update, 0.1), atol=0.01)


def test_a_stepped_optimizer_is_saved_and_resumed_with_its_moments(tmp_path):
    model, optimizer = _model_and_optimizer()
    _one_update(model, optimizer)
    path = _save(tmp_path, model, optimizer)
    assert json.loads((path / ckpt.STATE_FILE).read_text())["optimizer_stepped"] is True
    resumed_model, resumed_optimizer = _model_and_optimizer()
    _load(path, resumed_model, resumed_optimizer)
    step = resumed_optimizer.state[resumed_model.weight]["step"]
    assert float(step) == 1.0
    assert torch.allclose(_one_update(resumed_model, resumed_optimizer), _one_update(model, optimizer))


def test_an_optimizer_stepped_field_that_is_not_a_boolean_is_named(tmp_path):
    model, optimizer = _model_and_optimizer()
    path = _save(tmp_path, model, optimizer)
    state = json.loads((path / ckpt.STATE_FILE).read_text())
    (path / ckpt.STATE_FILE).write_text(json.dumps({**state, "optimizer_stepped": "no"}))
    with pytest.raises(ckpt.CheckpointError, match="optimizer_stepped"):
        _load(path, *_model_and_optimizer())
