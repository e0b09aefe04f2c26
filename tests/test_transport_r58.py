"""Session 58: an error on a process group after that group's timeout is the timeout's.

gloo closes every connection of a group in this process when one op on it times out. A full
suite on a loaded machine saw a trainer's drain of a live producer, whose END the closure lost,
fail with a timeout of its own (not the "pair closure" text), which named the live producer
(tests/test_failure_r57.py's drain case).
"""

from __future__ import annotations

from draftforge.splitserve import transport as T


class _Group:
    """A stand-in process group: only its identity matters to the record of timeouts."""


def test_a_later_timeout_on_a_timed_out_group_names_the_first_silent_peer():
    group = _Group()
    first = T._peer_died(2, group, "target", "waiting for a sample",
                         RuntimeError("[pair.cc:598] Timed out waiting 5000ms for recv operation to complete"))
    assert first.rank == 2
    later = T._peer_died(1, group, "target", "draining", RuntimeError("Timed out waiting 5000ms for recv"))
    assert later.rank == 2 and "target rank 2 sent nothing within the timeout" in str(later)
    closed = T._peer_died(1, group, "target", "draining", RuntimeError("Connection closed by peer [127.0.0.1]"))
    assert closed.rank == 2
    # another group is another matter: its first error is its own
    other = T._peer_died(1, _Group(), "target", "draining", RuntimeError("Connection closed by peer"))
    assert other.rank == 1 and "died or closed its connection" in str(other)
