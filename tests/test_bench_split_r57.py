"""Review round 57 of ``draftforge bench split`` with ``split.reuse_features``.

The stream interleaves epochs 0 and 1 (0/0, 0/1, 1/0, 0/2, 1/1, ...), and an epoch-1 visit
re-sends features computed in epoch 0, at next to no cost. Phase 1 timed the stream from its
start to the first chunk end past its token goal: chunk 0's computation and 0/1's before any
re-send, so its window held one or two computed chunks more than re-sent ones (5 and 3 at 8
chunks) and read the target's rate low, ``split_efficiency`` high where the target is the
slower side. Both windows, phase 1's and phase 3's steady one, now open at the first chunk's
end and close where they hold as many re-sent chunks as computed ones.
"""

from __future__ import annotations

import pytest
import torch
from test_bench_split import TINY

from draftforge.config import load_recipe
from draftforge.splitserve import bench_split
from draftforge.splitserve.bench_split import SteadyWindow, StepRecord, steady_rate
from draftforge.splitserve.producer import (
    EPOCH_MARK,
    SampleSource,
    Topology,
    epoch_id,
    id_epoch,
    load_source_conversations,
)
from draftforge.splitserve.target import build_target
from draftforge.train.sample import Sample


def _visits(*spec):
    """One step per visit, one sample a visit (its chunk end), 10 tokens: ``(epoch, seconds)``."""
    records, now = [], 0.0
    for epoch, seconds in spec:
        now += seconds
        records.append(StepRecord(now, [(0, 10, True, epoch)]))
    return records


def test_the_steady_window_with_reused_features_closes_after_as_many_resent_chunks_as_computed():
    # 0/0, 0/1, 1/0, 0/2, 1/1, 0/3: a computed chunk takes the trainer 1 s to get, a re-sent one 0.1 s
    records = _visits((0, 1.0), (0, 1.0), (1, 0.1), (0, 1.0), (1, 0.1), (0, 1.0))
    # from the end of 0/0 (1 s) to the end of 1/1 (3.2 s): 0/1, 1/0, 0/2, 1/1, two of each
    assert steady_rate(records, min_chunks=4, paired=True) == SteadyWindow(40 / 2.2, 4, 0.0, 0.0)
    assert steady_rate(records, min_chunks=5, paired=True) is None
    # without reuse_features any chunk end closes it: to the end of 0/3 (4.2 s), 3 computed, 2 re-sent
    assert steady_rate(records, min_chunks=4) == SteadyWindow(50 / 3.2, 5, 0.0, 0.0)
    # past the interleaved round every visit computes: any of its ends closes the window
    records += _visits((1, 0.1), (1, 0.1), (2, 1.0))
    records[-3:] = [StepRecord(r.end_s + records[5].end_s, r.samples) for r in records[-3:]]
    # 0/3, 1/2 and 1/3 end a round of 4 chunks: 1/2 leaves three of each, 1/3 a re-sent chunk
    # more than computed ones (it does not close the window), 2/x computes its chunk: it closes it
    assert steady_rate(records, min_chunks=4, paired=True) == SteadyWindow(80 / 4.4, 8, 0.0, 0.0)
    assert steady_rate(records[:8], min_chunks=4, paired=True) == SteadyWindow(60 / 3.3, 6, 0.0, 0.0)


def test_phase_3_records_the_epoch_of_each_sample():
    class Trainer:
        def train_step(self, micro):
            pass

    def sample(sample_id, chunk_end):
        ids = torch.ones(5, dtype=torch.long)
        return Sample(sample_id, ids, torch.ones(5, dtype=torch.bool), torch.zeros(5, 2), torch.zeros(5, 2),
                      provenance={"target_rank": 0, "chunk_end": chunk_end})

    batches = iter([[sample("a", False), sample("b", True)], [sample(f"a{EPOCH_MARK}1", True)],
                    [sample(f"c{EPOCH_MARK}2", True)]])
    records = bench_split._recorded_steps(Trainer(), batches, steps=3, grad_accum=1)
    assert [r.samples for r in records] == [[(0, 5, False, 0), (0, 5, True, 0)], [(0, 5, True, 1)],
                                            [(0, 5, True, 2)]]


class _Clock:
    """A stand-in for ``time`` in bench_split: one second a featurised row, nothing else."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class _TimedEngine:
    def __init__(self, engine, clock):
        self.engine, self.clock = engine, clock

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def features(self, input_ids, attention_mask=None):
        self.clock.now += int(input_ids.shape[0])
        return self.engine.features(input_ids, attention_mask)


def _epoch(sample_id: str) -> int:
    return int(sample_id.partition(EPOCH_MARK)[2] or 0)


@pytest.mark.parametrize("reuse", [True, False])
def test_phase_1_times_the_visits_the_steady_window_would(tmp_path, monkeypatch, reuse):
    cfg = load_recipe(TINY, [f"train.output_dir={tmp_path}", "data.num_samples=48",
                             "target.generation.batch_size=8", "target.generation.max_new_tokens=8",
                             f"split.reuse_features={str(reuse).lower()}"])
    clock = _Clock()
    monkeypatch.setattr(bench_split, "time", clock)
    engine = _TimedEngine(build_target(cfg.target, cfg.draft.target_layer_ids), clock)
    topology = Topology([0], [1])
    conversations, regenerate = load_source_conversations(cfg)
    chunks = SampleSource(cfg, engine, topology, 0, conversations=conversations,
                          regenerate=regenerate).chunks()
    first = {conversations[i].id for i in chunks[0]}
    per_chunk = None
    for goal_chunks in (1, 2, 3, 5):
        goal = (per_chunk or 1) * goal_chunks
        samples, tokens, seconds = bench_split.producer_window(cfg, engine, topology=topology, rank=0,
                                                               min_tokens=goal)
        # the visits, from the samples: each ends with its chunk's last sample
        visits, current = [], []
        for sample in samples:
            current.append(sample)
            if sample.chunk_last:
                visits.append(current)
                current = []
        assert not current and {s.sample_id for s in visits[0]} == first  # chunk 0 comes, untimed
        window = visits[1:]
        epochs = [_epoch(v[-1].sample_id) for v in window]
        assert tokens == sum(s.num_tokens for v in window for s in v)
        # the fake seconds: one per row featurised in the window, i.e. the rows of its visits
        # but the re-sent ones (epoch 1 with reuse_features)
        assert seconds == sum(len(v) for v, e in zip(window, epochs, strict=True) if not (reuse and e == 1))
        if reuse:  # as many re-sent chunks as computed ones, 1/0 ... 1/k after 0/1 ... 0/k+1
            assert epochs == [0, 1] * (len(window) // 2) and len(window) >= 2
        else:
            assert epochs == sorted(epochs) and len(window) >= 1
        # it closes at the first chunk end where it may: the goal reached, whole pairs
        step = 2 if reuse else 1
        shorter = sum(s.num_tokens for v in window[:-step] for s in v)
        assert tokens >= goal and (len(window) == step or shorter < goal)
        per_chunk = per_chunk or tokens // len(window)


def test_phase_1_reads_the_rate_of_whole_pairs():
    """With a computed chunk costing 1 s and a re-sent one nothing, the stream runs at two
    chunks a second: phase 1 reads that, where timing chunk 0 too read 8 chunks in 5 s (0.8 of it)."""
    visits = [0, 0, 1, 0, 1, 0, 1, 0]  # the first 8 visits of the interleaved round
    window = visits[1:]  # phase 1's window now: from the end of chunk 0 ...
    closing = bench_split.PairedVisits(True)
    ends = [n for n, epoch in enumerate(window, start=1) if closing.close_after(epoch)]
    assert ends == [2, 4, 6]  # ... to the end of 1/0, 1/1 or 1/2
    assert all(n / window[:n].count(0) == 2.0 for n in ends)
    assert len(visits) / visits.count(0) == 8 / 5  # what the old window read at 8 chunks
    unpaired = bench_split.PairedVisits(False)
    assert all(unpaired.close_after(epoch) for epoch in window)


def test_id_epoch_reads_the_epoch_mark():
    assert [id_epoch(i) for i in ("a", f"a{EPOCH_MARK}1", f"a{EPOCH_MARK}12")] == [0, 1, 12]
    assert id_epoch(f"{EPOCH_MARK}1") == 0  # no conversation id before the mark
    assert all(id_epoch(epoch_id("conv", e)) == e for e in (0, 1, 2, 12))  # epoch_id's inverse
