"""Resumes of the producer's assignment (splitserve/balance.py) that the first tests missed:
a run resumed from a checkpoint without recorded lengths, checkpointed and resumed again."""

from __future__ import annotations

from pathlib import Path

import pytest
from splitserve_helpers import tiny_recipe
from test_wire_r11 import _FakeEngine


def _streams(tmp_path: Path, consumed=None, *, producers=(0,), trainers=(1, 2, 3)) -> dict:
    """Every producer's stream, without processes: 23 conversations in chunks of 3 for three
    epochs, about half of them dropped for data.min_loss_tokens."""
    from draftforge.config import load_recipe
    from draftforge.splitserve.producer import (
        SampleSource,
        build_topology,
        load_source_conversations,
    )
    from draftforge.splitserve.target import load_tokenizer

    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = load_recipe(tiny_recipe(tmp_path, num_conversations=23, overrides={
        "split.max_epochs": 3, "split.target_ranks": list(producers),
        "split.trainer_ranks": list(trainers), "train.strategy": "fsdp2",
        "target.generation.batch_size": 3, "split.token_budget": 192,
        "data.min_loss_tokens": 20}))
    conversations, regenerate = load_source_conversations(cfg)
    engine = _FakeEngine(load_tokenizer(cfg.target))
    topology = build_topology(cfg.split)
    return {p: list(SampleSource(cfg, engine, topology, p, conversations=conversations,
                                 regenerate=regenerate, consumed=consumed,
                                 log=lambda text: None).samples())
            for p in topology.producers}


def _links(streams: dict, trainers) -> dict:
    return {d: [s for stream in streams.values() for s in stream if s.dest == d] for d in trainers}


def _checkpoint(links: dict, cut: dict, *, lengths: bool = True) -> dict:
    """What the trainers' checkpoint tells the producers (Trainer.resume's all_consumed) after
    each trainer consumed the first ``cut[d]`` samples of its link: each sample's tokens (None
    in a checkpoint written before they were recorded), 0 for each id dropped as too short
    that a consumed sample told of."""
    out = {}
    for d, link in links.items():
        for sample in link[: cut[d]]:
            out.update(dict.fromkeys(sample.dropped_ids, 0))
    for d, link in links.items():
        out.update((s.sample_id, s.num_tokens if lengths else None) for s in link[: cut[d]])
    return out


@pytest.mark.parametrize("producers, trainers, cuts", [
    ((0,), (1, 2, 3), [({1: 3, 2: 1, 3: 4}, {1: 5, 2: 9, 3: 2}), ({1: 6, 2: 6, 3: 6}, {1: 0, 2: 3, 3: 11})]),
    ((0, 1), (2, 3, 4), [({2: 2, 3: 4, 4: 5}, {2: 7, 3: 3, 4: 1})]),
])
def test_a_run_resumed_from_a_checkpoint_without_lengths_resumes_exactly_from_its_own(
        tmp_path, producers, trainers, cuts):
    """A checkpoint written before the lengths were recorded resumes (R1) with its consumed
    samples' tokens unknown, and R1's own checkpoints keep them unknown (None) beside the
    lengths of what R1's trainers consumed. A resume from such a checkpoint sent later samples
    elsewhere than R1 did: R1 had balanced the chunks it computed again (those its old
    checkpoint consumed in part) on all their samples' lengths, the second resume skipped any
    chunk holding an unknown length. Both now leave the unknown ones out alike."""
    full = _links(_streams(tmp_path / "full", producers=producers, trainers=trainers), trainers)
    for k, (cut1, cut2) in enumerate(cuts):
        old = _checkpoint(full, cut1, lengths=False)
        first = _links(_streams(tmp_path / f"r1-{k}", old, producers=producers, trainers=trainers),
                       trainers)
        # R1 loses and repeats nothing: with the old checkpoint's samples, every sample once
        ids = [s.sample_id for d in trainers for s in [*full[d][: cut1[d]], *first[d]]]
        assert sorted(ids) == sorted(s.sample_id for d in trainers for s in full[d])
        # R1 checkpoints after its trainers took cut2 more each; that resumes exactly
        consumed = {**old, **_checkpoint(first, cut2)}
        second = _links(_streams(tmp_path / f"r2-{k}", consumed, producers=producers,
                                 trainers=trainers), trainers)
        for d in trainers:
            assert [s.sample_id for s in second[d]] == [s.sample_id for s in first[d][cut2[d]:]], (k, d)

