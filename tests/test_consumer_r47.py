"""A trainer waiting for a sample fails with the acknowledgement link's error as soon as its
heartbeat meets a dead producer (a review of the streaming path, 2026-12-06). The error was
read only when the next sample came, and on NCCL a receive from a dead target rank blocks in
the GPU wait instead of raising, so the trainer waited until it was killed."""

from __future__ import annotations

import queue
import threading

from draftforge.splitserve import transport as T
from draftforge.splitserve.consumer import ConsumerStream


class _SilentReceiver(T.SampleReceiver):
    """A SampleReceiver whose receive thread is stuck (as in a GPU wait on a dead peer): its
    queue stays empty and it never records an error."""

    def __init__(self, sources):
        self.sources = list(sources)
        self.queue = queue.Queue()
        self.error = None
        self._held = dict.fromkeys(self.sources, 0)
        self._cond = threading.Condition()

    def depth(self) -> int:
        return 0


def test_a_waiting_trainer_raises_what_the_heartbeat_met():
    acks = T.AckLink([0], group=None, every_s=3600)
    stream = ConsumerStream(_SilentReceiver([0]), ack_group=None, acks=acks)
    died = T.PeerDied(0, "target", "heartbeat", "no reply within 8 s")
    outcome: list[BaseException] = []

    def take():
        try:
            next(stream.samples())
        except BaseException as exc:  # noqa: BLE001 - what the trainer's rank entry would see
            outcome.append(exc)

    waiting = threading.Thread(target=take, daemon=True)
    waiting.start()
    waiting.join(1.0)
    assert waiting.is_alive() and not outcome  # nothing came and nothing failed yet: it waits
    acks.error = died  # what the heartbeat thread records when a producer stops answering
    waiting.join(10.0)
    assert not waiting.is_alive(), "the trainer kept waiting after its heartbeat met a dead producer"
    assert outcome == [died]
    acks.close()


def test_get_runs_the_check_at_each_poll_and_returns_a_sample_that_comes():
    receiver = _SilentReceiver([0])
    polls = []
    assert receiver.get(poll_s=0.01, max_wait_s=0.1, check=lambda: polls.append(1)) is T.SampleReceiver.IDLE
    assert len(polls) >= 3
    receiver._held[0] = 1
    receiver.queue.put((0, "sample"))
    assert receiver.get(poll_s=0.01, check=lambda: 1 / 0) == (0, "sample")  # not checked: it came


def test_a_targets_done_figures_include_its_wait_for_the_trainers_stop(tmp_path, monkeypatch):
    """The target's "done (serving, to the trainers' stop)" line says it covers the wait for
    the trainers' stop (their last steps and checkpoint), but its clock stopped before that
    wait. Here the trainer stops 0.6 s after the stream's end: wall and idle time hold it."""
    import time

    import test_stream_r32 as harness

    from draftforge.splitserve import producer as P

    real = P.run_producer
    delayed = []

    def run_producer(cfg, engine, topology, rank, *, hellos, **kwargs):
        def stop_late(dest, **_):  # the trainer acknowledges the end only after its last steps
            def later():
                time.sleep(0.6)
                with hellos.cond:
                    hellos.stopped.add(dest)
                    hellos.cond.notify_all()
            delayed.append(threading.Thread(target=later, daemon=True))
            delayed[-1].start()

        monkeypatch.setattr(T, "send_end", stop_late)
        return real(cfg, engine, topology, rank, hellos=hellos, **kwargs)

    monkeypatch.setattr(P, "run_producer", run_producer)
    _, summary, _, _ = harness._run_producer(tmp_path, monkeypatch, {"split.max_epochs": 1})
    assert delayed, "the stream's end was never sent"
    assert summary["idle_s"] >= 0.55 and summary["wall_s"] >= summary["busy_s"] + 0.55, summary
