"""A ``FeatureRunnerProcess`` runner for test_workers_r37: rank 1 fails while rank 0 is stopped
in the middle of taking its rows from the parent, if taking them means fetching anything.

Spawned children import it by name, so it lives in a module of its own.
"""

from __future__ import annotations

import time
from multiprocessing import connection, resource_sharer
from pathlib import Path

from tp_runner_helpers import GlooShardedRunner


def _wait_for(*markers: Path) -> None:
    deadline = time.monotonic() + 60
    while not any(marker.exists() for marker in markers):
        if time.monotonic() > deadline:
            raise TimeoutError(f"none of {[marker.name for marker in markers]} appeared")
        time.sleep(0.01)


class FetchStoppedRunner(GlooShardedRunner):
    """``server_args["markers"]``: a folder where the two ranks leave files for each other.

    Rank 0 fetches a descriptor from the parent's ``resource_sharer`` only after rank 1 has
    its rows (the sharer serves one fetch at a time), and then stays inside the handshake, as
    a child killed there would leave it. Rank 1 fails once rank 0 is in that handshake or has
    its rows without one, and the parent then stops rank 0 where it is.
    """

    def __init__(self, server_args: dict, *, tp_rank: int = 0) -> None:
        super().__init__(server_args, tp_rank=tp_rank)
        self.markers = Path(server_args["markers"])
        if tp_rank == 0:
            markers, detach = self.markers, resource_sharer.DupFd.detach

            def late_detach(self: resource_sharer.DupFd) -> int:
                _wait_for(markers / "rank1-has-rows")
                return detach(self)

            def stuck_handshake(conn: connection.Connection, authkey: bytes) -> None:
                (markers / "rank0-fetching").touch()
                time.sleep(600)

            resource_sharer.DupFd.detach = late_detach
            connection.answer_challenge = stuck_handshake

    def features(self, rows):
        if self.tp_rank == 1:
            (self.markers / "rank1-has-rows").touch()
            _wait_for(self.markers / "rank0-fetching", self.markers / "rank0-has-rows")
            raise ValueError("boom on tensor-parallel rank 1")
        (self.markers / "rank0-has-rows").touch()
        return super().features(rows)  # waits in the all-reduce for rank 1 until stopped
