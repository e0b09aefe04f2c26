"""A rank started by splitserve.supervisor in tests/test_supervisor.py.

Modes (argv[1]): ``ok`` joins a gloo group, all-reduces its rank and writes what
it saw; ``hold`` does the same, then waits for a release file (so the test can
inspect the job's sockets while every rank is connected); ``fail`` makes rank 1
exit 3 while rank 0 blocks in a collective that can never finish; ``stubborn``
ignores SIGINT (noting it in a file) and SIGTERM and sleeps (a rank stuck in C
code); ``race`` has rank 1
kill itself with SIGKILL and rank 0 exit 3 at the same moment, once both are ready and rank
1 is about to die (its reaction, as a trainer's to a dead target); ``late_abort`` has rank 0 exit 2 and rank 1
abort (SIGABRT) 3 s after it, as an NCCL watchdog does after a peer vanished.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _dead(pid: int) -> bool:
    """Whether process ``pid`` has ended: no /proc entry, or a zombie (state Z) not yet reaped.
    0 (its pid not written yet) is not."""
    if not pid:
        return False
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def main(mode: str, out_dir: str) -> int:
    out = Path(out_dir)
    rank = int(os.environ["RANK"])
    if mode == "fail" and rank == 1:
        return 3
    if mode == "stubborn":
        import signal

        # SIGINT noted (the test's proof that the launcher passed it on), not acted on
        signal.signal(signal.SIGINT, lambda *_: (out / f"rank{rank}.sigint").touch())
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        (out / f"rank{rank}.ready").touch()
        time.sleep(600)
        return 0
    if mode == "late_abort":  # rank 0 fails; rank 1 aborts 3 s later, as a watchdog would
        import signal

        # timed from rank 0's exit, not from this rank's start: on a loaded machine the two
        # finish importing torch seconds apart
        if rank == 0:
            (out / "rank0.exiting").touch()
            os._exit(2)  # at once (interpreter teardown takes seconds on a loaded machine)
        deadline = time.monotonic() + 60
        while not (out / "rank0.exiting").exists():
            if time.monotonic() > deadline:
                return 4
            time.sleep(0.01)
        time.sleep(3.0)
        os.kill(os.getpid(), signal.SIGABRT)
    if mode == "race":
        import signal

        # meet first: the two ranks finish importing torch seconds apart on a loaded machine,
        # and rank 0 must exit within the launcher's grace after rank 1's death
        (out / f"rank{rank}.ready").touch()
        deadline = time.monotonic() + 60
        while not all((out / f"rank{r}.ready").exists() for r in (0, 1)):
            if time.monotonic() > deadline:
                return 4
            time.sleep(0.01)
        if rank == 1:
            (out / "rank1.killing").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        # rank 0 leaves only once rank 1 is dead (gone, or a zombie its launcher has not reaped):
        # on a loaded machine rank 1's loop over the ready files can run a second or more after
        # rank 0's, or it can stall between its file and its kill, and the launcher then saw
        # rank 0's exit a poll or two before rank 1's death, no longer "at the same moment"
        while not (out / "rank1.killing").exists() or not _dead(int((out / "rank1.killing").read_text() or 0)):
            if time.monotonic() > deadline:
                return 4
            time.sleep(0.001)
        os._exit(3)  # at once, as the real ranks leave (interpreter teardown takes seconds)
    dist.init_process_group("gloo")
    value = torch.tensor([float(rank)])
    if mode == "fail":
        dist.barrier()  # rank 1 never arrives
        return 0
    dist.all_reduce(value)
    record = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
    record.update(sum=value.item(), pid=os.getpid())
    # whole or absent: the test reads it as soon as it exists (an empty file read as JSON
    # failed a full suite's run on a loaded machine)
    (out / f"rank{rank}.json.tmp").write_text(json.dumps(record))
    os.replace(out / f"rank{rank}.json.tmp", out / f"rank{rank}.json")
    if mode == "hold":
        while not (out / "release").exists():
            time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
