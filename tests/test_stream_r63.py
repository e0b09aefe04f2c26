"""Session 63: what a review of the streaming found in its messages and accounting.

- A trainer rank whose steps were all fillers (another rank held every sample) was told
  "no training step", and its summary printed zeros for a target it never heard from.
- ``split.max_in_flight``'s refusal counted target ranks where the check counts target
  groups (one producer per tensor-parallel group).
- One target rank whose whole share was too short read as if every conversation were.
"""

from __future__ import annotations

import json
import time

import pytest
from splitserve_helpers import tiny_recipe
from test_wire_r11 import _FakeEngine

from draftforge.config import load_recipe
from draftforge.errors import InputError
from draftforge.splitserve.accounting import ConsumerAccounting
from draftforge.splitserve.producer import SampleSource, build_topology, load_source_conversations
from draftforge.splitserve.roles import recipe_split_problems
from draftforge.splitserve.target import load_tokenizer


def test_a_rank_that_stepped_on_fillers_is_not_told_it_ran_no_step():
    acc = ConsumerAccounting(world=4, num_target=1, credits=4, num_sources=1)
    time.sleep(0.05)
    # a step ran on every trainer rank; this rank's micro-batch was a filler: no id of its own
    acc.on_step({"step": 1, "tokens": 76, "compute_s": 0.04, "wait_s": 0.005, "sample_ids": ["conv-0010"]})
    text = acc.summary_text()
    assert "no training step" not in text
    assert "not measured (this rank trained no sample of its own), no split recommended" in text
    assert "target  (per producer): no report (no sample reached this trainer rank)" in text
    assert "busy 0.0%  idle 0.0%  0 tokens" not in text.splitlines()[1]


def test_a_rank_without_a_step_still_says_so():
    acc = ConsumerAccounting(world=2, num_target=1, credits=4, num_sources=1)
    assert "not measured (no training step), no split recommended (now 1 target + 1 trainer)" in acc.summary_text()


def test_max_in_flight_is_counted_in_target_groups(tmp_path):
    """4 target ranks in 2 tensor-parallel groups feed one trainer: 2 links, so 2 credits do."""
    (tmp_path / "model").mkdir()  # a local target folder (never loaded: the checks only)
    (tmp_path / "model" / "config.json").write_text(json.dumps({'num_hidden_layers': 4, 'hidden_size': 64, 'vocab_size': 8192, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'intermediate_size': 128, 'max_position_embeddings': 512}))

    def problems(credits):
        (tmp_path / "recipe.yaml").unlink(missing_ok=True)
        cfg = load_recipe(tiny_recipe(tmp_path, overrides={
            "target.backend": "sglang", "target.model": str(tmp_path / "model"), "target.shape": None,
            "split.target_ranks": [0, 1, 2, 3], "split.trainer_ranks": [4],
            "split.target_tensor_parallel": 2, "split.max_in_flight": credits,
            "split.comm_backend": "nccl", "train.device": "cuda"}))
        return [p for p in recipe_split_problems(cfg) if p.startswith("split.max_in_flight")]

    assert problems(1) == [
        "split.max_in_flight: 1 is less than the 2 target groups (one per 2 tensor-parallel target "
        "ranks) feeding one trainer; every link needs at least one credit: set it to at least 2"]
    assert problems(2) == []


def test_max_in_flight_names_target_ranks_without_tensor_parallelism(tmp_path):
    cfg = load_recipe(tiny_recipe(tmp_path, overrides={
        "split.target_ranks": [0, 1, 2], "split.trainer_ranks": [3], "split.max_in_flight": 2}))
    assert ("split.max_in_flight: 2 is less than the 3 target ranks feeding one trainer; every link "
            "needs at least one credit: set it to at least 3") in recipe_split_problems(cfg)


def test_a_rank_whose_share_is_all_too_short_says_it_is_its_share(tmp_path):
    """11 conversations among 3 target ranks; at min_loss_tokens 20 the third rank's 3 are all
    too short while the others' are not (the reviewer's case)."""
    cfg = load_recipe(tiny_recipe(tmp_path, num_conversations=11, overrides={
        "split.max_epochs": 1, "split.target_ranks": [0, 1, 2], "split.trainer_ranks": [3, 4, 5],
        "train.strategy": "fsdp2", "target.generation.batch_size": 2, "data.min_loss_tokens": 20}))
    conversations, regenerate = load_source_conversations(cfg)
    topology = build_topology(cfg.split)
    engine = _FakeEngine(load_tokenizer(cfg.target))

    def produce(rank):
        return list(SampleSource(cfg, engine, topology, rank, conversations=conversations,
                                 regenerate=regenerate, log=lambda text: None).samples())

    assert len(produce(0)) > 0 and len(produce(1)) > 0
    with pytest.raises(InputError) as refused:
        produce(2)
    assert str(refused.value) == (
        "target rank 2: epoch 0 produced no sample (every conversation of its share (3 of the 11 "
        "conversations, split among 3 target ranks) had fewer than data.min_loss_tokens=20 supervised "
        "tokens); more data (data.num_samples) or fewer target ranks gives each rank samples")
