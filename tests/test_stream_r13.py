"""Review round 13 of SplitServe streaming and accounting (splitserve/)."""

from __future__ import annotations

import math
import types
from fractions import Fraction

import pytest
import torch

from draftforge.splitserve.accounting import ConsumerAccounting, recommend_split
from draftforge.splitserve.producer import Topology

# --------------------------------------------------------------------------- accounting


def _lockstep_rate(num_t: int, world: int, producer: float, consumer: float, tp: int = 1) -> float:
    """The job's rate from the topology itself: trainers step in lockstep on equal shares, so
    the producer owning the largest share of the order's positions sets the target side's pace."""
    topology = Topology(producers=tuple(range(0, num_t, tp)), trainers=tuple(range(num_t, world)))
    num_r = world - num_t
    positions = num_r * math.lcm(*range(1, len(topology.producers) + 1))  # whole rounds
    owners = [topology.producer_of(n) for n in range(positions)]
    largest = max(Fraction(owners.count(p), positions) for p in topology.producers)
    return min(float(Fraction(producer) / largest), num_r * consumer)


def test_the_recommended_split_counts_producers_that_feed_more_trainers_than_others():
    """2 target ranks feeding 3 trainers: target 0 feeds trainers 0 and 2, target 1 trainer 1,
    so target 0 must produce two thirds of the tokens and the pair feeds 1.5 x one target's
    capacity, not 2 x. The split (and its expected rate) came from 2 x, so with 100 tok/s on
    both sides it recommended 2 + 3 at 200 tok/s, which runs at 150; 3 + 2 runs at 200."""
    for world, producer, consumer in ((5, 100.0, 100.0), (5, 100.0, 60.0), (7, 100.0, 45.0),
                                      (8, 90.0, 50.0), (6, 100.0, 30.0)):
        best = max(((t, world - t, _lockstep_rate(t, world, producer, consumer))
                    for t in range(1, world)), key=lambda x: (x[2], -x[0]))
        num_t, num_r, rate = recommend_split(world, producer, consumer)
        assert (num_t, num_r) == best[:2] and math.isclose(rate, best[2]), (world, producer, consumer)
    assert recommend_split(5, 100.0, 100.0)[:2] == (3, 2)
    # tensor-parallel pairs: 6 target ranks are 3 producers for 2 trainers (one feeds 2/4)
    best = max(((t, 10 - t, _lockstep_rate(t, 10, 100.0, 100.0, tp=2)) for t in (2, 4, 6, 8)),
               key=lambda x: (x[2], -x[0]))
    num_t, num_r, rate = recommend_split(10, 100.0, 100.0, tensor_parallel=2)
    assert (num_t, num_r) == best[:2] and math.isclose(rate, best[2])


def test_the_slower_side_of_an_uneven_split_is_the_overloaded_target():
    """2 targets at 100 tok/s, 3 trainers at 60: the pair feeds 150 tok/s (target 0 serves two
    trainers) against the trainers' 180, so the target is the slower side; the summary said
    "trainer" (2 x 100 against 3 x 60)."""
    acc = ConsumerAccounting(world=5, num_target=2, credits=4)
    acc.on_producer_stats(0, {"busy_s": 1.0, "idle_s": 0.0, "wall_s": 1.0, "tokens": 100})
    acc.on_take(depth=1, tokens=60, waited_s=0.0)
    acc.on_step({"compute_s": 1.0, "wait_s": 0.0})
    s = acc.snapshot()
    assert s["producer"]["capacity_tok_s"] == 100.0 and s["consumer"]["capacity_tok_s"] == 60.0
    assert _lockstep_rate(2, 5, 100.0, 60.0) == 150.0
    assert s["recommended"] == {"target_ranks": 2, "trainer_ranks": 3, "expected_tok_s": 150.0}
    assert "slower side: target; recommended split for 5 ranks: 2 target + 3 trainer" in acc.summary_text()


# --------------------------------------------------------------------------- launcher preflight


def test_finite_data_too_small_for_one_step_of_every_trainer_is_refused_before_any_rank_starts(tmp_path):
    """3 conversations, split.max_epochs=1, 2 trainers with train.grad_accum=2: one step needs 2
    micro-batches of each trainer's own samples, 4 samples at least. The job started anyway,
    loaded the target, trained nothing ("step 0/..., stop: data_exhausted"), wrote a step-0
    checkpoint and exited 0."""
    from splitserve_helpers import tiny_recipe

    from draftforge.config import load_recipe
    from draftforge.data.formats import DataFormatError
    from draftforge.splitserve.launch import preflight

    def recipe(folder: str, count: int, epochs: int):
        (tmp_path / folder).mkdir()
        return load_recipe(tiny_recipe(tmp_path / folder, trainers=2, num_conversations=count, overrides={
            "split.max_epochs": epochs, "train.grad_accum": 2}))

    with pytest.raises(DataFormatError) as caught:
        preflight(recipe("small", 3, 1))
    assert str(caught.value) == (
        f"data.train_files ['{tmp_path / 'small' / 'convs.jsonl'}']: 3 conversations x "
        "split.max_epochs=1 give at most 3 samples, and one step of every trainer needs 4 at least "
        "(2 trainer ranks x train.grad_accum=2); add data "
        "(data.num_samples), raise split.max_epochs or use fewer trainer ranks")
    preflight(recipe("two_epochs", 3, 2))  # 6 samples: enough for a step
    preflight(recipe("enough", 4, 1))


class _Receiver:
    """A SampleReceiver's interface over a list: one source (target rank 0), nothing queued."""

    def __init__(self, samples):
        self.sources = [0]
        self._items = [(0, s) for s in samples]

    def depth(self) -> int:
        return 0

    def get(self, poll_s: float = 0.5, max_wait_s: float | None = None, check=None):
        return self._items.pop(0) if self._items else None


def test_the_trainers_tokens_and_samples_are_those_its_steps_trained(monkeypatch):
    """Samples of 30, 50, 20, 40 and 60 tokens, a budget of 100: a batch closes when the next
    sample does not fit, so the packer had taken the third batch's first sample (60) when the
    second step ended, and the run stopped there (train.steps). Its tokens counted as trained:
    the trainer read 200 tokens for 140 trained, capacity 200 tok/s for 140, and a step took
    2.5 samples instead of 2."""
    from draftforge.splitserve import accounting as A
    from draftforge.splitserve import transport as T
    from draftforge.splitserve.consumer import ConsumerStream, stream_pack

    clock = [0.0]
    monkeypatch.setattr(A, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    lengths = {"a": 30, "b": 50, "c": 20, "d": 40, "e": 60}
    wires = [T.WireSample(sample_id=i, input_ids=torch.arange(n), loss_mask=torch.ones(n, dtype=torch.bool),
                          aux=torch.zeros(n, 2), final=torch.zeros(n, 2), seq_no=k,
                          producer_stats={"busy_s": 0.5, "idle_s": 0.0, "wall_s": 1.0, "tokens": 200.0})
             for k, (i, n) in enumerate(lengths.items())]
    acc = ConsumerAccounting(world=2, num_target=1, credits=4)
    acks = types.SimpleNamespace(check=lambda: None, ack=lambda src, count: None)
    stream = ConsumerStream(_Receiver(wires), ack_group=None, accounting=acc, acks=acks)
    batches = stream_pack(stream.samples(), 100)
    trained = []
    for _ in range(2):  # two steps of one micro-batch, 0.5 s of compute each
        batch = next(batches)
        clock[0] += 0.5
        trained += [s.sample_id for s in batch]
        # a step's ids are every trainer rank's: another rank's are not this one's tokens
        acc.on_step({"compute_s": 0.5, "wait_s": 0.0, "sample_ids": [s.sample_id for s in batch] + ["z"]})
    assert trained == ["a", "b", "c", "d"] and acc.depth_series()[-1][1] == 1  # "e" taken: 5 takes
    assert acc.takes == 5
    s = acc.snapshot()
    tokens = sum(lengths[i] for i in trained)
    assert (s["samples"], s["consumer"]["tokens"]) == (4, tokens) == (4, 140)
    assert (s["consumer"]["rate_tok_s"], s["consumer"]["capacity_tok_s"]) == (140.0, 140.0)
    assert "  trainer (this rank): busy 100.0%  idle 0.0%  140 tokens  140 tok/s  capacity 140 tok/s" \
        in acc.summary_text()


def test_accounting_jsonl_recommends_no_split_where_a_side_was_not_measured(tmp_path):
    """The summary says "no split recommended" for a trainer that ran no step, but the records
    of accounting.jsonl ("start", and the "summary" of such a run) held
    {"target_ranks": 1, "trainer_ranks": 1, "expected_tok_s": 0.0}: a split advised from nothing
    for a script that reads them."""
    import json

    path = tmp_path / "accounting.jsonl"
    acc = ConsumerAccounting(world=2, num_target=1, credits=4, path=path)
    acc.begin(0)
    acc.on_producer_stats(0, {"busy_s": 2.0, "idle_s": 0.5, "wall_s": 4.0, "tokens": 300})
    acc.on_take(depth=1, tokens=120, waited_s=0.5)
    acc.write("summary", 0)
    assert "no split recommended" in acc.summary_text()
    acc.on_step({"compute_s": 3.0, "wait_s": 0.0})  # measured on both sides: 150 vs 40 tok/s
    acc.write("summary", 1)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["event"], r["recommended"]) for r in records] == [
        ("start", None), ("summary", None),
        ("summary", {"target_ranks": 1, "trainer_ranks": 1, "expected_tok_s": 40.0})]


# --------------------------------------------------------------------------- documentation


def _keys(value, out: set[str]) -> set[str]:
    if isinstance(value, dict):
        for key, inner in value.items():
            out.add(key)
            _keys(inner, out)
    return out


def test_the_readme_describes_every_field_of_accounting_jsonl(tmp_path):
    """The README described metrics.jsonl and summary.json field by field but never named
    accounting.jsonl's records or fields (the figures the split advice rests on). Every key
    of a start, an interval and a summary record, as ConsumerAccounting writes them, is named."""
    import json
    from pathlib import Path

    path = tmp_path / "accounting.jsonl"
    acc = ConsumerAccounting(world=2, num_target=1, credits=4, path=path)
    acc.begin(0)
    acc.on_producer_stats(0, {"busy_s": 2.0, "idle_s": 0.5, "wall_s": 4.0, "tokens": 300})
    acc.on_take(depth=1, tokens=120, waited_s=0.5)
    acc.on_step({"compute_s": 3.0, "wait_s": 0.0})
    acc.line()
    acc.write("interval", 1)
    acc.write("summary", 1)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["event"] for r in records] == ["start", "interval", "summary"]
    keys = set()
    for record in records:
        _keys(record, keys)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("`accounting.jsonl`, "):]
    section = section[: section.index("\n\n")]
    missing = sorted(k for k in keys | {"start", "interval", "summary"} if f"`{k}`" not in section
                     and f'`"{k}"`' not in section)
    assert missing == []
    assert "`null` until both sides are measured" in section
