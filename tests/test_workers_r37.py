"""A feature-runner child stopped while it takes its rows prints nothing in the parent.

``FeatureRunnerProcess.features`` sent the token ids as CPU tensors: torch hands a CPU
tensor's storage over as a file descriptor, which the parent's multiprocessing
``resource_sharer`` thread serves until the child fetches it. When one tensor-parallel rank
failed, ``close(force=True)`` stopped the others, and one stopped inside that fetch made the
parent's thread print ``ConnectionResetError: [Errno 104] Connection reset by peer`` with its
traceback (seen at random in test_sglang_runner's failing-rank test, and on a user's terminal
when a rank fails under ``tp_size`` > 1). Here rank 0 is stopped in the fetch every time, if
there is one to stop it in.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

SCRIPT = textwrap.dedent("""
    import sys, time
    import torch
    from workers_r37_helpers import FetchStoppedRunner
    from draftforge.splitserve.sglang_runner import FeatureRunnerProcess

    runner = FeatureRunnerProcess({"tp_size": 2, "markers": sys.argv[1]},
                                  runner_cls=FetchStoppedRunner)
    processes = list(runner._processes)
    try:
        runner.features([torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9, 2])])
    except RuntimeError as exc:
        print(exc)
    else:
        sys.exit("features() did not raise")
    assert not any(process.is_alive() for process in processes)
    time.sleep(2)  # the time for a sharer thread to print what it would
""")


@pytest.mark.distributed
def test_a_rank_stopped_while_taking_its_rows_leaves_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ("feature runner (tensor-parallel rank 1 of 2) failed while computing features"
            in done.stdout)
    assert "ValueError: boom on tensor-parallel rank 1" in done.stdout
    assert "resource_sharer" not in done.stderr, done.stderr
    assert "ConnectionResetError" not in done.stderr, done.stderr
    # rank 0 had its rows without fetching a descriptor from the parent
    assert (tmp_path / "rank0-has-rows").exists()
    assert not (tmp_path / "rank0-fetching").exists()
