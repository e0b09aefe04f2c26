"""Round 37: a failed checkpoint names the trainer by the rank the launcher and the log prefixes
use. The message counted trainers within their group ("trainer rank 0") where the same process
logged as "[rank 1 trainer]" and the launcher reported "trainer rank 1 failed" (CI of stop 45,
a full disk: a one-target, one-trainer run)."""

from __future__ import annotations

import pytest
from test_checkpoint_edges import _errors
from test_trainer_distributed import launch


@pytest.mark.distributed
def test_a_failed_save_names_the_job_rank_of_the_trainer_that_failed(tmp_path):
    # three processes; the trainer group is job ranks 1 and 2 (rank 0 stands where a target would
    # be and trains nothing); the group's second trainer, job rank 2, fails its own RNG file
    train = dict(strategy="fsdp2", dtype="float32", steps=4, checkpoint_interval=2)
    with pytest.raises(AssertionError):
        launch(tmp_path, "fail", world=3, trainer_ranks=[1, 2], train=train, fail_save_rank=1,
               pg_timeout_s=30, timeout=120)
    # the worker writes OUT.rank<i>.error with i the rank within the trainer group (2 trainers)
    for error in _errors(tmp_path, "fail", 2):
        assert error["type"] == "CheckpointError" and error["step"] == 2
        assert "(trainer rank 2: OSError: [Errno 28] No space left on device" in error["message"]
        assert "trainer rank 1:" not in error["message"]


@pytest.mark.distributed
def test_an_unshared_output_dir_names_the_job_ranks_of_the_trainers(tmp_path):
    train = dict(strategy="fsdp2", dtype="float32", steps=4, checkpoint_interval=2, output_dir="run")
    with pytest.raises(AssertionError):
        launch(tmp_path, "split", world=3, trainer_ranks=[1, 2], train=train, rank_dirs=True,
               pg_timeout_s=30, timeout=120)
    first = tmp_path / "split" / "node0" / "run"  # the worker's folder per rank within the group
    for message in (error["message"] for error in _errors(tmp_path, "split", 2)):
        assert message.startswith(
            "train.output_dir run must be on storage shared by all trainer ranks (trainer rank 2 "
            f"does not see {tmp_path / 'split' / 'node1' / 'run' / '.shared-check-'}")
        assert f"which trainer rank 1 wrote as {first / '.shared-check-'}" in message


def test_job_ranks_outside_torch_distributed_is_rank_zero():
    from draftforge.train import distributed as D

    assert D.job_ranks(group=None) == [0]
