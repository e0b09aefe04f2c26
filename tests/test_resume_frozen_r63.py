"""Session 63: a resumed run keeps the target's embedding and lm_head as its rank sent them.

Every strategy's checkpoint load put back the earlier segment's copies of the frozen matrices
over the ones the target rank had just sent: after a resume against another revision of the
target (or in another dtype), the draft trained against the first segment's target, and its
export carried it. A read-only review of the trainer found it under single, fsdp2 and ZeRO-3.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_trainer_distributed import ALL_ANCHORS, launch
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.train.sample import pack
from draftforge.train.trainer import Trainer

FROZEN = ("embed_tokens.weight", "lm_head.weight")


def _trainer(run, seed: int, **overrides) -> Trainer:
    return Trainer(model_config=tiny_model_config(), train=train_config(str(run), **overrides),
                   embeddings=target_embeddings(seed), run_dir=run, recipe_yaml="name: test\n")


def test_single_resumes_with_the_frozen_matrices_the_target_sent(tmp_path):
    run = tmp_path / "run"
    first = _trainer(run, 7, steps=2, checkpoint_interval=2)
    first.fit(pack(chain_samples(20), 90)[:2])
    again = _trainer(run, 8, steps=3, resume="auto")  # another revision of the target, same shape
    assert again.resume().step == 2
    embed, head = target_embeddings(8)
    assert torch.equal(again.model.embed_tokens.weight, embed)
    assert torch.equal(again.model.lm_head.weight, head)
    assert not torch.equal(embed, target_embeddings(7)[0])
    # the trainable weights are the checkpoint's
    for name, value in first.model.state_dict().items():
        if name not in FROZEN:
            assert torch.equal(again.model.state_dict()[name], value), name


def test_single_resumed_in_another_dtype_keeps_this_segments_precision(tmp_path):
    run = tmp_path / "run"
    _trainer(run, 7, steps=2, checkpoint_interval=2, dtype="bfloat16").fit(pack(chain_samples(20), 90)[:2])
    again = _trainer(run, 7, steps=3, resume="auto", dtype="float32")
    again.resume()
    embed, head = target_embeddings(7)
    assert torch.equal(again.model.lm_head.weight, head)  # not its bf16 rounding
    assert not torch.equal(head, head.to(torch.bfloat16).float())


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", [
    dict(strategy="fsdp2"),
    pytest.param(dict(strategy="deepspeed", zero_stage=3), marks=pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")),
], ids=["fsdp2", "zero3"])
def test_distributed_resumes_with_the_frozen_matrices_the_target_sent(tmp_path, strategy):
    train = dict(strategy, dtype="float32", steps=2, num_anchors=ALL_ANCHORS, checkpoint_interval=2)
    launch(tmp_path, "first", world=2, trainer_ranks=[0, 1], train=train, timeout=240, run="run")
    rest = launch(tmp_path, "rest", world=2, trainer_ranks=[0, 1], train=dict(train, steps=3, resume="auto"),
                  timeout=240, run="run", embeddings_seed=8)
    assert rest["resumed_step"] == 2 and rest["steps"] == [3]
    embed, head = target_embeddings(8)
    torch.testing.assert_close(rest["state"]["embed_tokens.weight"], embed, rtol=0, atol=0)
    torch.testing.assert_close(rest["state"]["lm_head.weight"], head, rtol=0, atol=0)
