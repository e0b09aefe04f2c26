"""Session 58: a scheduler's SIGTERM to the whole process group reaches each rank twice.

Directly, and again through the launcher, which passes SIGTERM on (milliseconds apart). The
rank's first SIGTERM unwound it and set SIGTERM's default action, so the copy killed it while
it wrote its interrupted summary: summary.json missing, the run folder's lock left behind
(seen 1 time in 7 with a group SIGTERM; every time with two SIGTERMs 1 ms apart, below).
"""

from __future__ import annotations

import json
import os
import signal
import time

from test_splitserve_runs import train_to_a_checkpoint


def _rank_pid(launcher: int, rank: int) -> int:
    """The process id of the launcher's child whose RANK is ``rank`` (Linux's /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            environ = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if stat[1] == str(launcher) and f"RANK={rank}".encode() in environ:
            return int(entry)
    raise AssertionError(f"no rank {rank} under process {launcher}")


def test_a_sigterm_and_its_copy_still_write_the_interrupted_summary(tmp_path):
    proc = train_to_a_checkpoint(tmp_path)
    try:
        trainer = _rank_pid(proc.pid, 1)
    except AssertionError as exc:
        proc.kill()
        raise AssertionError(f"{exc}\n{proc.communicate()[0][-3000:]}") from None
    os.kill(trainer, signal.SIGTERM)
    time.sleep(0.001)
    os.kill(trainer, signal.SIGTERM)  # the launcher's copy of a group-wide SIGTERM
    out, _ = proc.communicate(timeout=90)
    assert "[rank 1 trainer] stopped on SIGTERM" in out, out[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_reason"] == "interrupted"
    assert not (tmp_path / "run" / ".train.lock").exists()
    # the interrupted segment's accounting too: its summary record, at the summary's step, and
    # the end block (neither was written when a signal stopped a segment)
    records = [json.loads(line) for line in (tmp_path / "run" / "accounting.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"]) for r in records if r["event"] != "interval"][-1] == ("summary", summary["step"])
    assert "split accounting:" in out


def test_two_ranks_failing_in_one_poll_say_the_wait_once(capsys):
    """Both ranks exit 1 long before the second poll (1 s apart): each printed its own
    "failed ...; waiting up to 15 s" line, though the launcher waits once (round 58)."""
    import sys

    from draftforge.splitserve.supervisor import run_ranks

    command = [sys.executable, "-c", "import sys, time; time.sleep(0.2); sys.exit(1)"]
    status = run_ranks(command, nproc=2, poll_s=1.0, grace_s=2.0)
    assert status == 1
    err = capsys.readouterr().err
    assert err.count("waiting up to 2 s for the other ranks to stop") == 1, err
    assert "rank 0 failed (exit status 1)" in err


def test_no_time_measured_is_no_share_of_other_work():
    """A rerun of a finished run trains no step: the trainer's shares are 0 of 0 s, and the
    end block said "other 100.0% (checkpoints, logging)" of that (round 58)."""
    from draftforge.splitserve.accounting import _other, side_summary

    nothing = side_summary(0.0, 0.0, 0.0, 0)
    assert _other(nothing, ".1%") == ""
    saved = side_summary(6.0, 2.0, 10.0, 100)  # 2 s of 10 outside steps and waits
    assert _other(saved, ".1%") == " other 20.0% (checkpoints, logging)"
