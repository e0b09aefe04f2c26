"""A producer's assignment of samples to trainers (splitserve/balance.py): balanced by the
micro-batches the trainers pack, carried over the run, replayed on resume."""

from __future__ import annotations

import json
import random
from collections import deque

import pytest
import torch
from test_wire_r11 import _streams
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.splitserve.balance import PackedBalance
from draftforge.splitserve.consumer import stream_pack
from draftforge.train import checkpoint as ckpt
from draftforge.train.sample import Sample, pack
from draftforge.train.trainer import Trainer


class _Len:
    """Just what stream_pack reads of a sample."""

    def __init__(self, n: int) -> None:
        self.num_tokens = n


def test_the_replayed_packer_closes_micro_batches_where_the_trainers_packer_does():
    rng = random.Random(3)
    lengths = [rng.randint(1, 300) for _ in range(500)]
    balance = PackedBalance(1, 512)
    closed = []
    for n in lengths:
        before = balance.packed[0]
        balance.add(0, n)
        closed.append(balance.packed[0] > before)
    batches = [len(b) for b in stream_pack([_Len(n) for n in lengths], 512)]
    assert balance.packed[0] + 1 == len(batches)  # the open one is the stream's last
    assert balance.count[0] == batches[-1]
    starts = [i for i, c in enumerate(closed) if c]  # samples that opened a new micro-batch
    assert starts == [sum(batches[:k]) for k in range(1, len(batches))]


def test_assign_by_hand():
    # budget 100: [60] | [60]: tie at 0 -> dest 0; dest 1 (0 < 60); 30 -> dest 0 (60 = 60, first)
    # packs [60, 30]? 2 * 60 = 120 > 100: dest 0 closes [60] and opens [30] (progress 130);
    # 10 -> dest 1 (60 < 130): 2 * 60 = 120 > 100, closes [60], opens [10] (110)
    balance = PackedBalance(2, 100)
    assert balance.assign([60, 60, 30, 10]) == [0, 1, 0, 1]
    assert (balance.packed, balance.count, balance.longest) == ([1, 1], [1, 1], [30, 10])
    # short samples share a micro-batch, each going where the open one is least full:
    # 20 -> dest 1 (110 < 130; [10, 20] is 2 * 20 = 40 <= 100, progress 140);
    # 5 -> dest 0 (130 < 140; [30, 5]: 160); 5 -> dest 1 (140 < 160; [10, 20, 5]: 160)
    assert balance.assign([20]) == [1]
    assert balance.assign([5, 5]) == [0, 1]
    assert (balance.count, balance.longest) == ([2, 3], [30, 20])
    # ties go to the first dest in the order the rotation names
    assert PackedBalance(3, 100).assign([7, 7, 7], rotation=2) == [2, 0, 1]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="num_dests"):
        PackedBalance(0, 10)
    with pytest.raises(ValueError, match="token_budget"):
        PackedBalance(2, 0)
    with pytest.raises(ValueError, match="at least one token"):
        PackedBalance(2, 10).add(0, 0)


def _most_waiting(assign, *, dests: int, chunks: int, chunk: int, budget: int, lengths) -> int:
    """The lockstep consumer of issue 4's trainers: every step takes one micro-batch packed
    greedily from each trainer's queue; the producer answers a chunk whenever some trainer
    cannot make its step. Returns the most tokens ever queued for one trainer."""
    rng = random.Random(0)
    queues = [deque() for _ in range(dests)]

    def step_ready(queue) -> bool:  # a micro-batch is closed once the next sample is known
        longest, taken = 0, 0
        for n in queue:
            if taken and max(longest, n) * (taken + 1) > budget:
                return True
            longest, taken = max(longest, n), taken + 1
        return False

    most = 0
    for position in range(chunks):
        sizes = [lengths(rng) for _ in range(chunk)]
        for n, dest in zip(sizes, assign(sizes, position), strict=True):
            queues[dest].append(n)
        while all(step_ready(q) for q in queues):
            for q in queues:
                batch = next(stream_pack([_Len(n) for n in q], budget))
                for _ in batch:
                    q.popleft()
        most = max(most, *(sum(q) for q in queues))
    return most


def _by_tokens(dests: int):
    """The rule this replaced: each chunk balanced by tokens on its own, longest first."""
    def assign(sizes, position):
        loads, out = [0] * dests, [0] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
            d = min(range(dests), key=lambda b: (loads[b], (b - position) % dests))
            out[i], loads[d] = d, loads[d] + sizes[i]
        return out
    return assign


@pytest.mark.parametrize("dests", [2, 4])
def test_what_waits_for_a_trainer_stays_within_a_few_micro_batches(dests):
    """At Ling-like lengths (a long tail up to max_length = the budget), balancing tokens
    chunk by chunk let one trainer's queue grow with the run (here to 21 and 26 budgets'
    worth by 1,000 chunks, at 2 and 4 trainers); balancing the packed micro-batches keeps it
    within two budgets."""
    budget = 8192

    def lengths(rng):
        return min(budget, int(rng.lognormvariate(7.3, 0.9)))

    balance = PackedBalance(dests, budget)
    kept = _most_waiting(lambda sizes, position: balance.assign(sizes, rotation=position),
                         dests=dests, chunks=1000, chunk=64, budget=budget, lengths=lengths)
    assert kept <= 2 * budget, kept
    drifted = _most_waiting(_by_tokens(dests), dests=dests, chunks=1000, chunk=64, budget=budget,
                            lengths=lengths)
    assert drifted > 15 * budget, drifted  # the model above shows the old rule's growth


def test_a_resume_without_recorded_lengths_loses_and_repeats_nothing(tmp_path, capsys):
    """A checkpoint written before the lengths were recorded: the producer cannot replay the
    assignment, says so, and still sends every unconsumed sample exactly once."""
    streams, _, _ = _streams(tmp_path)
    every = [s.sample_id for s in streams[0]]
    consumed = dict.fromkeys(every[:10])  # lengths unknown
    resumed, _, _ = _streams(tmp_path / "resumed", consumed)
    assert sorted(s.sample_id for s in resumed[0]) == sorted(every[10:])
    assert "does not record the lengths" in capsys.readouterr().err


def _trainer(tmp_path, **overrides) -> Trainer:
    return Trainer(model_config=tiny_model_config(), train=train_config(**overrides),
                   embeddings=target_embeddings(), run_dir=tmp_path, recipe_yaml="name: test\n")


def test_the_checkpoint_records_each_consumed_samples_tokens_for_the_producers(tmp_path):
    samples: list[Sample] = chain_samples(24)
    samples[2].provenance["dropped_ids"] = ("gone-1",)
    result = _trainer(tmp_path, steps=2).fit(pack(samples, 90))
    trained = [i for ids in result.sample_ids for i in ids]
    tokens = {s.sample_id: s.num_tokens for s in samples}
    state_file = ckpt.checkpoint_path(tmp_path, 2) / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["consumed_tokens"] == [[tokens[i] for i in trained]]
    info = _trainer(tmp_path, steps=4, resume="auto").resume()
    assert info.all_consumed == {**{i: tokens[i] for i in trained}, "gone-1": 0}
    # written before the field existed: the ids resume, their tokens unknown
    del state["consumed_tokens"]
    state_file.write_text(json.dumps(state))
    info = _trainer(tmp_path, steps=4, resume="auto").resume()
    assert info.all_consumed == {**dict.fromkeys(trained), "gone-1": 0}


@pytest.mark.parametrize("tokens, problem", [
    ([[3]], "one for each of its 'consumed_ids'"),
    ("x", "'consumed_tokens' is not a list"),
    ([[0, 5]], "positive token counts"),
    ([[True, 5]], "positive token counts"),
])
def test_damaged_token_counts_are_refused_naming_the_field(tokens, problem):
    state = {"skipped_steps": 0, "strategy": "single", "consumed_ids": [["a", "b"]],
             "consumed_tokens": tokens}
    assert problem in ckpt._state_problem(state)
    state["consumed_tokens"] = [[4, None]]  # a resumed old checkpoint's unknown ones, then known
    assert ckpt._state_problem(state) == ""


def test_the_producer_counts_the_tokens_waiting_for_each_trainer():
    from draftforge.splitserve.producer import PendingSamples, ProducedSample

    def sample(dest, n):
        return ProducedSample(dest=dest, sample_id=f"s{dest}-{n}", input_ids=torch.zeros(n, dtype=torch.long),
                              loss_mask=torch.ones(n, dtype=torch.bool), aux=torch.zeros(n, 1),
                              final=torch.zeros(n, 1))

    pending = PendingSamples([1, 2])
    assert not pending.any()
    for dest, n in [(1, 30), (2, 50), (1, 40)]:
        pending.append(sample(dest, n))
    assert pending.max_tokens == 70 and pending.any()
    assert pending.popleft(1).num_tokens == 30  # in order
    pending.append(sample(1, 20))  # 40 + 20 = 60: below the most so far
    assert pending.max_tokens == 70
    pending.clear(2)
    pending.append(sample(2, 75))  # counted from zero after the clear
    assert pending.max_tokens == 75 and [s.num_tokens for s in pending[1]] == [40, 20]
