"""How many CPU cores this process may use."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity where the OS reports one.

    ``os.cpu_count()`` counts the machine's cores, which overstates what a process
    pinned by ``taskset``, a container's cpuset or a batch scheduler can use.
    """
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
