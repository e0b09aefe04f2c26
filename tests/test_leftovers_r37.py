"""Round 37 leftovers: train.zero_stage set where no strategy reads it."""

from __future__ import annotations

import pytest
from splitserve_helpers import read_logs, spawn_ranks, tiny_recipe, wait_all

from draftforge.config import load_recipe
from draftforge.splitserve.dry_run import dry_run
from draftforge.train.config import ignored_zero_stage_note

NOTE = "train.zero_stage 3 is ignored: it is the ZeRO stage of train.strategy deepspeed"


@pytest.mark.parametrize(("strategy", "stage", "said"), [
    ("fsdp2", 3, "this run's strategy is fsdp2 (FSDP2 shards parameters, gradients and optimizer "
                 "state anyway, as ZeRO-3 does)"),
    ("single", 3, "this run's strategy is single (one trainer rank shards nothing)"),
    ("fsdp2", 2, None),  # the default stage says nothing
    ("deepspeed", 3, None),  # read
])
def test_a_zero_stage_no_strategy_reads_is_noted_in_the_dry_run(tmp_path, strategy, stage, said):
    """train.zero_stage=3 beside fsdp2 trained exactly as without it, without a word: a user
    asking for ZeRO-3 memory savings under FSDP2 was not told the key does nothing there."""
    trainers = 1 if strategy == "single" else 2
    cfg = load_recipe(tiny_recipe(tmp_path, trainers=trainers),
                      [f"train.strategy={strategy}", f"train.zero_stage={stage}"])
    note = ignored_zero_stage_note(cfg.train)
    text = dry_run(cfg)
    if said is None:
        assert note is None and "ZeRO stage of train.strategy" not in text  # (the config lists the key)
        return
    assert note == f"{NOTE}, and {said}"
    assert f"note: {note}" in text.splitlines()


@pytest.mark.distributed
def test_a_run_with_an_ignored_zero_stage_says_so_once(tmp_path):
    recipe = tiny_recipe(tmp_path, steps=2, overrides={"train.zero_stage": 3, "train.checkpoint_interval": 100})
    procs = spawn_ranks(recipe, 2, log_dir=tmp_path / "logs")
    assert wait_all(procs, 120) == [0, 0], read_logs(tmp_path / "logs", 2)
    target, trainer = read_logs(tmp_path / "logs", 2)
    assert NOTE not in target
    [line] = [line for line in trainer.splitlines() if NOTE in line]
    assert line.startswith("[rank 1 trainer] note: ")
