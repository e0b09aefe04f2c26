"""Session 50: stopping the SGLang feature runner waits once for all its processes."""

from __future__ import annotations

from draftforge.splitserve import sglang_runner


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class _StuckProcess:
    """A tensor-parallel child stuck in a collective: it never returns, runs no handler for
    SIGTERM, and dies of SIGKILL only. ``join`` advances the fake clock by its timeout."""

    def __init__(self, clock, waits):
        self.clock, self.waits, self.alive = clock, waits, True

    def is_alive(self):
        return self.alive

    def join(self, timeout=None):
        if self.alive:
            self.waits.append(timeout)
            self.clock.now += timeout or 0.0

    def terminate(self):
        pass

    def kill(self):
        self.alive = False


class _Conn:
    def send(self, message):
        pass

    def close(self):
        pass


def test_a_stop_waits_once_for_all_stuck_processes_not_once_each(monkeypatch):
    """Each of the tensor-parallel processes got 30 s of its own to return, one after another:
    with four stuck ones the close took over two minutes, long past the 45 s the launcher gives
    a rank before SIGKILL, so the processes' own SIGKILL never came from the runner."""
    clock, waits = _Clock(), []
    monkeypatch.setattr(sglang_runner.time, "monotonic", clock)
    runner = object.__new__(sglang_runner.FeatureRunnerProcess)
    runner._processes = [_StuckProcess(clock, waits) for _ in range(4)]
    runner._conns = [_Conn() for _ in range(4)]
    processes = list(runner._processes)
    runner.close()
    assert not any(p.alive for p in processes)  # killed in the end
    assert clock.now <= sglang_runner.STOP_WAIT_S + 10 < 45  # the stop's wait, then 10 s after SIGTERM
    assert sum(waits) == clock.now
