"""``usable_cores``: the cores a process may run on, not the machine's count."""

from __future__ import annotations

import os

import pytest

from draftforge import cores


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this OS")
def test_follows_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert cores.usable_cores() == 1


def test_falls_back_to_the_machine_count(monkeypatch, tmp_path):
    monkeypatch.setattr(cores, "CGROUP", tmp_path)  # no quota: the CI machine's must not count
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert cores.usable_cores() == 6
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert cores.usable_cores() == 1
