"""Balance across trainers with SEVERAL target ranks (splitserve/producer.py, splitserve/balance.py).

Each producer balances its own samples across its own trainers (:class:`PackedBalance`), but
with at most as many producers as trainers every trainer is fed by one producer alone
(:class:`Topology`), and the conversations are shared between producers by COUNT
(:meth:`Topology.producer_of`), not by the micro-batches their samples make: a producer whose
share holds more samples dropped for ``data.min_loss_tokens``, or shorter ones, feeds its
trainers fewer micro-batches, and nothing makes up for it. Each epoch walks the same share, so
the gap grows with ``split.max_epochs`` (2 target ranks x 2 trainers, 48 conversations, 8
epochs: 32 against 44 micro-batches). Balancing across producers needs a channel between them
that they do not have; what the trainer does instead (``Trainer.fit``, tests/test_train_r60.py)
is to run a step wherever one trainer has a full one, the others joining with micro-batches that
supervise nothing, so that with a finite ``split.max_epochs`` the better-fed trainers' excess
still trains (it was left untrained: 24 of those 152 samples).

The streams here are the producers' own (:class:`SampleSource`, a fake engine, no processes);
what each trainer receives (its sources in strict rotation, as ``SampleReceiver``), the
micro-batches it packs are an independent, slow reference
(not ``stream_pack`` nor ``PackedBalance``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from splitserve_helpers import tiny_recipe
from test_wire_r11 import _FakeEngine

BUDGET = 192  # 2 of these 61-81-token samples a micro-batch


def _streams(tmp_path: Path, producers, trainers, *, conversations: int, epochs: int,
             min_loss_tokens: int = 20) -> tuple[object, dict[int, list[tuple[int, str, int]]]]:
    """The topology and each producer's stream as ``(trainer, sample id, tokens)``, in order."""
    from draftforge.config import load_recipe
    from draftforge.splitserve.producer import (
        SampleSource,
        build_topology,
        load_source_conversations,
    )
    from draftforge.splitserve.target import load_tokenizer

    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = load_recipe(tiny_recipe(tmp_path, num_conversations=conversations, overrides={
        "split.max_epochs": epochs, "split.target_ranks": list(producers),
        "split.trainer_ranks": list(trainers), "train.strategy": "fsdp2",
        "target.generation.batch_size": 3, "split.token_budget": BUDGET,
        "data.min_loss_tokens": min_loss_tokens}))
    convs, regenerate = load_source_conversations(cfg)
    engine = _FakeEngine(load_tokenizer(cfg.target))
    topology = build_topology(cfg.split)
    streams = {p: [(s.dest, s.sample_id, s.num_tokens)
                   for s in SampleSource(cfg, engine, topology, p, conversations=convs,
                                         regenerate=regenerate, log=lambda text: None).samples()]
               for p in topology.producers}
    return topology, streams


def _received(topology, streams, trainer: int) -> list[int]:
    """The lengths ``trainer`` takes, in order: its sources in strict rotation from the first,
    an ended source leaving the rotation where it stood (``SampleReceiver`` of a fresh run)."""
    links = [[n for dest, _, n in streams[p] if dest == trainer] for p in topology.sources(trainer)]
    out: list[int] = []
    index = 0
    while links:
        at = index % len(links)
        if not links[at]:
            links.pop(at)
            index = at
            continue
        out.append(links[at].pop(0))
        index += 1
    return out


def _micro_batches(lengths: list[int], budget: int) -> list[int]:
    """The sizes of the micro-batches a trainer packs of ``lengths``: each takes samples in
    order while (samples) x (longest) stays within the budget (a sample alone always fits)."""
    sizes: list[int] = []
    start = 0
    while start < len(lengths):
        end = start + 1
        while end < len(lengths) and (end + 1 - start) * max(lengths[start : end + 1]) <= budget:
            end += 1
        sizes.append(end - start)
        start = end
    return sizes


def _measure(tmp_path, producers, trainers, *, conversations: int, epochs: int):
    topology, streams = _streams(tmp_path, producers, trainers, conversations=conversations,
                                 epochs=epochs)
    ids = [sample_id for stream in streams.values() for _, sample_id, _ in stream]
    assert len(ids) == len(set(ids))  # every sample once
    assert {dest for stream in streams.values() for dest, _, _ in stream} <= set(trainers)
    batches = {t: _micro_batches(_received(topology, streams, t), BUDGET) for t in trainers}
    return batches, len(ids)


def test_the_reference_matches_the_producers_own_replay_with_one_producer(tmp_path):
    """One producer balances its trainers itself: the reference counts the micro-batches its
    PackedBalance replayed, within one of each other."""
    from draftforge.splitserve.balance import PackedBalance

    trainers = (1, 2, 3)
    topology, streams = _streams(tmp_path, (0,), trainers, conversations=23, epochs=3)
    replay = PackedBalance(len(trainers), BUDGET)
    for dest, _, n in streams[0]:
        replay.add(trainers.index(dest), n)
    batches = {t: _micro_batches(_received(topology, streams, t), BUDGET) for t in trainers}
    assert [len(batches[t]) for t in trainers] == [packed + 1 for packed in replay.packed]
    assert replay.count == [batches[t][-1] for t in trainers]
    assert max(map(len, batches.values())) - min(map(len, batches.values())) <= 1


@pytest.mark.parametrize("epochs, counts", [(3, [10, 10]), (8, [38, 38])])
def test_one_producer_keeps_its_trainers_micro_batches_together(tmp_path, epochs, counts):
    batches, _ = _measure(tmp_path, (0,), (1, 2), conversations=23 if epochs == 3 else 48, epochs=epochs)
    assert [len(b) for b in batches.values()] == counts


@pytest.mark.parametrize("producers, trainers, conversations, epochs, counts", [
    ((0, 1), (2, 3), 23, 3, {2: 9, 3: 11}),
    ((0, 1, 2), (3, 4), 23, 3, {3: 9, 4: 11}),  # more producers than trainers: each fed by several
    ((0, 1), (2, 3), 48, 8, {2: 32, 3: 44}),  # the gap grows with the epochs
])
def test_several_producers_feed_their_trainers_unevenly(tmp_path, producers, trainers, conversations,
                                                         epochs, counts):
    """The producers' streams as they are: the trainers' micro-batch counts drift apart, epoch
    after epoch. The figures pin today's split, so that a change of it shows here; the trainer
    ranks cope with the gap at the end of the data (tests/test_train_r60.py)."""
    batches, total = _measure(tmp_path, producers, trainers, conversations=conversations,
                              epochs=epochs)
    assert {t: len(b) for t, b in batches.items()} == counts
    assert sum(map(sum, batches.values())) == total  # every sample in some micro-batch
