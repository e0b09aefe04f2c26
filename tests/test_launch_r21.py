"""Review round 21 of the launcher (``draftforge train``): splitserve.launch, supervisor,
multinode, dry_run and the rank entry ``python -m draftforge.train``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ENV = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")

# rank 0 ignores SIGINT and SIGTERM (a rank stuck in a collective with a dead peer); rank 1
# fails with status 3 once rank 0 is ready
STUCK_AND_FAILING = (
    "import os, signal, sys, time\n"
    "out = sys.argv[1]\n"
    "rank = int(os.environ['RANK'])\n"
    "if rank == 0:\n"
    "    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "    open(os.path.join(out, 'rank0.pid'), 'w').write(str(os.getpid()))\n"
    "    time.sleep(600)\n"
    "deadline = time.monotonic() + 60\n"
    "while not os.path.exists(os.path.join(out, 'rank0.pid')) and time.monotonic() < deadline:\n"
    "    time.sleep(0.02)\n"
    "os._exit(3)\n"
)


def _wait_for(predicate, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.distributed
def test_ctrl_c_while_the_failed_job_waits_its_grace_kills_the_ranks_at_once(tmp_path):
    """A rank failed; the others get grace_s to explain themselves. A Ctrl-C then (the user
    does not want to wait) ends the job at once: the rank left is killed, the launcher exits
    130, never restarted, naming the failure it stopped after. Before, the Ctrl-C changed
    nothing: the launcher waited out the whole grace, then SIGTERM's term_s."""
    rank = tmp_path / "rank.py"
    rank.write_text(STUCK_AND_FAILING)
    err_path = tmp_path / "launcher.err"
    code = (
        "import sys; from draftforge.splitserve.supervisor import run_ranks; "
        f"sys.exit(run_ranks([sys.executable, {str(rank)!r}, {str(tmp_path)!r}], nproc=2, "
        "labels={1: 'trainer rank 1'}, grace_s=30.0, term_s=30.0))"
    )
    with open(err_path, "w") as err:
        launcher = subprocess.Popen([sys.executable, "-c", code], env=ENV, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err, text=True)
    try:
        _wait_for(lambda: "trainer rank 1 failed (exit status 3)" in err_path.read_text(),
                  "rank 1 never failed", timeout=120)
        started = time.monotonic()
        launcher.send_signal(signal.SIGINT)
        launcher.wait(timeout=45)
        took = time.monotonic() - started
        rank0 = int((tmp_path / "rank0.pid").read_text())
        assert not Path(f"/proc/{rank0}").exists(), "the stuck rank outlived its launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        pid_file = tmp_path / "rank0.pid"
        if pid_file.exists():  # never leave the stuck rank behind, whatever happened
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    err = err_path.read_text()
    assert launcher.returncode == 130, err
    assert took < 20.0, (took, err)
    assert "SIGINT: killing rank 0 (SIGKILL)" in err
    assert "stopped on SIGINT after trainer rank 1 failed (exit status 3); rerun the same" in err
    assert "(Ctrl-C stops them now)" in err


def test_after_a_rank_refused_its_input_the_last_line_says_to_fix_it_before_rerunning(
        tmp_path, monkeypatch, capsys):
    """A rank refused its input (status 2: a bad data row, a full disk) in a run that has a
    checkpoint: the last line must not just say "rerun the same command to resume", which
    fails the same way, but to fix what the rank named first."""
    from splitserve_helpers import tiny_recipe

    from draftforge.errors import InputError
    from draftforge.splitserve import launch
    from draftforge.splitserve.roles import note_input_error
    from draftforge.train import checkpoint as ckpt

    recipe = tiny_recipe(tmp_path)
    step = tmp_path / "run" / "checkpoints" / "step_00000004"

    def job(*args, env, **kwargs):
        with pytest.MonkeyPatch.context() as rank:
            rank.setattr(os, "environ", {**env, "RANK": "0"})
            note_input_error(InputError("data.train_files convs.jsonl: line 3: no messages"))
        return 2

    monkeypatch.setattr(launch, "run_ranks", job)
    monkeypatch.setattr(launch, "preflight", lambda cfg, **kwargs: None)
    monkeypatch.setattr(ckpt, "find_resume", lambda run_dir, resume: step)
    assert launch.main([str(recipe)]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("draftforge train: the job failed (exit status 2)"), last
    assert ("A rank refused its input, and the same command would fail the same way: fix what "
            "its message names first. Then rerun the same command to resume from the newest "
            f"checkpoint in {tmp_path / 'run'}") in last, last
    # any other failure: rerunning is the advice, as before
    monkeypatch.setattr(launch, "run_ranks", lambda *a, **k: 137)
    assert launch.main([str(recipe)]) == 137
    last = capsys.readouterr().err.splitlines()[-1]
    assert "refused its input" not in last and "Rerun the same command to resume" in last, last


def test_a_node_of_a_multinode_job_prints_the_torchrun_command_as_one_types_it(
        tmp_path, monkeypatch, capsys):
    """The line naming what a node runs was ``-m torch.distributed.run --nnodes=2 ...`` (the
    interpreter dropped, nothing quoted): not a command one can run or compare with the dry
    run's ``which runs: torchrun ...``."""
    from splitserve_helpers import tiny_recipe

    from draftforge.splitserve import launch

    (tmp_path / "my data").mkdir()
    recipe = tiny_recipe(tmp_path / "my data", overrides={"split.num_nodes": 2})
    monkeypatch.setattr(launch, "run_torchrun", lambda *a, **k: 0)
    assert launch.main([str(recipe), "--node-rank", "1", "--master-addr", "10.0.0.5"]) == 0
    err = capsys.readouterr().err
    expected = (f"draftforge train: node 1 runs: torchrun --nnodes=2 --nproc_per_node=1 "
                f"--node_rank=1 --master_addr=10.0.0.5 --master_port=29500 --rdzv-conf=timeout=120 -m draftforge.train "
                f"'{recipe}'")
    assert expected in err.splitlines(), err
