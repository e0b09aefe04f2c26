"""A trainer's wait for data includes the lockstep check that some trainer has a full step:
time spent there waiting for another trainer's data counted as neither busy nor idle, so
with several trainers the reporting rank's idle share was short (review round 35)."""

from __future__ import annotations

import time

from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

import draftforge.train.trainer as trainer_mod
from draftforge.train.sample import pack
from draftforge.train.trainer import Trainer


def test_the_wait_for_other_trainers_data_counts_as_waiting(tmp_path, monkeypatch):
    trainer = Trainer(model_config=tiny_model_config(num_hidden_layers=1),
                      train=train_config(steps=3, checkpoint_interval=100),
                      embeddings=target_embeddings(), run_dir=tmp_path, recipe_yaml="name: t\n")
    lag = 0.3  # another trainer's data arrives this much later, every step
    real = trainer_mod.D.all_reduce

    def lockstep(tensor, *args, **kwargs):
        if kwargs.get("op") is trainer_mod.dist.ReduceOp.MAX and tensor.numel() == 2:
            time.sleep(lag)  # the have-a-full-step check, held up by the slower trainer
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(trainer_mod.D, "all_reduce", lockstep)
    result = trainer.fit(pack(chain_samples(12), 160) * 4)
    assert result.steps_run == 3
    assert all(w >= lag for w in result.wait_s), result.wait_s  # each step's wait holds the lag
    assert result.summary["wait_s"] >= 3 * lag
