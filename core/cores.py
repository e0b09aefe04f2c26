"""How many CPU cores this process may use."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")  # a container sees its own cgroup here


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity where the OS reports one, lowered to
    its cgroup's CPU quota (rounded up) where it has one.

    ``os.cpu_count()`` counts the machine's cores, which overstates what a process
    pinned by ``taskset``, a container's cpuset or a batch scheduler can use; the affinity
    in turn overstates what a container limited by a quota (``docker run --cpus``, a
    Kubernetes CPU limit) can use: it keeps every core of the host.
    """
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return min(cores, quota) if quota is not None else cores


def cgroup_cpu_quota() -> int | None:
    """The CPUs that the cgroup's quota allows, rounded up (at least 1); None where there is no
    quota or no cgroup file (not Linux). Reads cgroup v2's ``cpu.max`` ("200000 100000", or
    "max 100000" without a quota), else cgroup v1's ``cpu.cfs_quota_us`` (-1 without one)."""
    try:
        quota, period = (CGROUP / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (CGROUP / "cpu" / "cpu.cfs_quota_us").read_text()
            period = (CGROUP / "cpu" / "cpu.cfs_period_us").read_text()
        except OSError:
            return None
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:  # "max": no quota
        return None
    if quota_us <= 0 or period_us <= 0:
        return None
    return max(1, math.ceil(quota_us / period_us))
