"""Review round 9 of the training loop: a resume under another learning-rate schedule."""

from __future__ import annotations

import json
import shutil

import pytest
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.train.sample import pack
from draftforge.train.trainer import Trainer, lr_at

SCHEDULE = dict(steps=20, warmup_ratio=0.25, checkpoint_interval=2)  # 5 warmup steps


def _trainer(run_dir, **overrides) -> Trainer:
    return Trainer(model_config=tiny_model_config(), train=train_config(**{**SCHEDULE, **overrides}),
                   embeddings=target_embeddings(), run_dir=run_dir, recipe_yaml="name: test\n")


@pytest.fixture(scope="module")
def in_warmup(tmp_path_factory):
    """A run stopped by its data at step 2, in its warmup: the checkpoint of step 2."""
    run_dir = tmp_path_factory.mktemp("warmup")
    assert _trainer(run_dir, resume="never").fit(pack(chain_samples(12), 90)[:2]).step == 2
    return run_dir


@pytest.mark.parametrize(("changed", "says"), [
    (dict(min_lr_ratio=0.5), "train.min_lr_ratio 0.0 -> 0.5"),
    # 40 * 0.125 is 5 warmup steps, as before, but the cosine now spans 35 steps instead of 15
    (dict(steps=40, warmup_ratio=0.125), "train.steps 20 -> 40, train.warmup_ratio 0.25 -> 0.125"),
])
def test_a_schedule_change_that_keeps_the_next_rate_is_still_noted(in_warmup, changed, says):
    """Step 3's rate is 3/5 of train.lr under either schedule (in warmup, hand-derived), so
    comparing that one rate said nothing, though every rate after the warmup differs."""
    old, new = train_config(**SCHEDULE), train_config(**{**SCHEDULE, **changed})
    assert lr_at(2, train=old) == lr_at(2, train=new) == pytest.approx(3 / 5 * old.lr)
    assert lr_at(10, train=old) != pytest.approx(lr_at(10, train=new))
    note = _trainer(in_warmup, resume="auto", **changed).resume().schedule_change
    assert note == (f"this recipe's learning-rate schedule differs from the checkpointed run's ({says}): "
                    f"step 3 keeps the learning rate {3 / 5 * old.lr:.3e}, the steps after it follow the "
                    "new schedule")


def test_a_resume_whose_rates_are_all_the_same_says_nothing(in_warmup, tmp_path):
    """The same recipe, or a warmup_ratio that rounds up to the same 5 warmup steps (20 * 0.21
    is 4.2): every rate is as it was. A checkpoint without the settings (written before they
    were stored) compares the next rate only, as it did."""
    assert _trainer(in_warmup, resume="auto").resume().schedule_change == ""
    assert _trainer(in_warmup, resume="auto", warmup_ratio=0.21).resume().schedule_change == ""
    state_file = in_warmup / "checkpoints" / "step_00000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["schedule"]["settings"]
    older = tmp_path / "older"
    older.mkdir()
    shutil.copytree(in_warmup / "checkpoints", older / "checkpoints")
    (older / "checkpoints" / "step_00000002" / "trainer_state.json").write_text(json.dumps(state))
    assert _trainer(older, resume="auto", min_lr_ratio=0.5).resume().schedule_change == ""
