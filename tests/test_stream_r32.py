"""Review round 32 of SplitServe streaming (splitserve/producer.py, transport.py, consumer.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from splitserve_helpers import tiny_recipe
from test_wire_r11 import _FakeEngine

from draftforge.config import load_recipe
from draftforge.splitserve import producer as P
from draftforge.splitserve import transport as T
from draftforge.splitserve.target import load_tokenizer


class _Listener:
    """An AckListener's shared state without its threads: every trainer has sent its resume
    state (``consumed``); credits and stops are set by the fake wire below."""

    def __init__(self, dests, consumed=None):
        self.srcs = list(dests)
        self.consumed = dict.fromkeys(dests, 0)
        self.stopped: set[int] = set()
        self.heard = dict.fromkeys(dests, time.monotonic())
        self.error = None
        self.cond = threading.Condition()
        self._ids = dict(consumed or {})

    def result(self):
        return dict(self._ids)

    def fail(self, exc):
        with self.cond:
            self.error = self.error or exc
            self.cond.notify_all()

    def join(self, timeout=None):
        pass


class _Pulse:
    def __init__(self):
        self.lock = threading.Lock()
        self.waiting: set[int] = set()

    def expect(self, dests, listens=None, on_error=None):
        self.waiting = set(dests)

    def close(self):
        pass


def _run_producer(tmp_path: Path, monkeypatch, overrides: dict, num_conversations: int = 23, *,
                  edit_data=None, forwarded: list | None = None):
    """``run_producer`` of target rank 0 in this process, its trainers taking each sample at
    once and stopping at its END; returns the summary, what went on the wire and the log.
    ``edit_data`` is called on the recipe's data file before the run; ``forwarded`` collects
    the dropped ids the samples carry."""
    recipe = tiny_recipe(tmp_path, num_conversations=num_conversations, overrides=overrides)
    if edit_data is not None:
        edit_data(tmp_path / "convs.jsonl")
    cfg = load_recipe(recipe)
    engine = _FakeEngine(load_tokenizer(cfg.target))
    topology = P.build_topology(cfg.split)
    listener, sent, logs = _Listener(topology.dests(0)), [], []

    def send_sample(dest, sample_id, *args, dropped_ids=(), **kwargs):
        sent.append((dest, sample_id))
        if forwarded is not None:
            forwarded.extend(dropped_ids)
        with listener.cond:
            listener.consumed[dest] += 1
            listener.cond.notify_all()

    def send_end(dest, **kwargs):
        sent.append((dest, None))
        with listener.cond:
            listener.stopped.add(dest)
            listener.cond.notify_all()

    monkeypatch.setattr(T, "send_sample", send_sample)
    monkeypatch.setattr(T, "send_end", send_end)
    summary = P.run_producer(cfg, engine, topology, 0, data_group=None, ack_group=None,
                             log=logs.append, pulse=_Pulse(), hellos=listener)
    return cfg, summary, sent, logs


def test_the_samples_a_target_drops_or_cuts_are_counted_and_said(tmp_path, monkeypatch):
    """A training run whose tokenisation dropped conversations for data.min_loss_tokens and cut
    others to data.max_length said neither: the producer counted both, returned only the drops
    in a summary no one printed (the rank's 'done:' line names neither) and left the cut ones
    out of it. Checked against the tokeniser's own counts: each conversation once, though two
    epochs tokenised it."""
    from draftforge.data.tokenize import tokenize_conversations

    cfg, summary, sent, logs = _run_producer(
        tmp_path, monkeypatch, {"split.max_epochs": 2, "data.min_loss_tokens": 20,
                                "data.max_length": 70})
    conversations, _ = P.load_source_conversations(cfg)
    _, stats = tokenize_conversations(conversations, load_tokenizer(cfg.target),
                                      max_length=70, min_loss_tokens=20)
    assert stats.num_dropped_short > 0 and stats.num_truncated > 0  # the data does both
    dropped, cut = stats.num_dropped_short, stats.num_truncated
    assert len([s for s in sent if s[1] is not None]) == 2 * stats.num_kept
    assert (summary["dropped_short"], summary.get("truncated")) == (dropped, cut)
    said = [line for line in logs if "data.min_loss_tokens" in line]
    assert len(said) == 1, logs
    assert f"{dropped} conversations dropped" in said[0] and f"{cut} cut to data.max_length=70" in said[0]
