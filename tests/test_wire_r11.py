"""SplitServe data path, round 11: the SAMPLE message's layout and edge sizes, a target rank
dying inside a sample, in-order packing, the sharded order over epochs, and the accounting
of a trainer that took samples but ran no step."""

from __future__ import annotations

import json
import os
import random
import types
from pathlib import Path

import pytest
import torch
from splitserve_helpers import run_on_ranks, tiny_recipe
from test_stream_r9 import _loopback

from draftforge.splitserve import transport as T
from draftforge.splitserve.accounting import ConsumerAccounting
from draftforge.splitserve.consumer import stream_pack
from draftforge.train.sample import Sample

# --------------------------------------------------------------------------- wire format


def test_the_sample_header_holds_each_field_where_the_format_says(monkeypatch):
    """The header, read as raw int64s, against the layout the transport's docstring gives:
    [MAGIC, SAMPLE, S, aux_dim, final_dim, dtype, id_bytes, seq_no, busy_us, idle_us,
    tokens, wall_us, chunk_end, n_dropped, dropped_bytes, 0]; then ints = ids, mask, id
    bytes, dropped lengths, dropped bytes; then [S, aux + final] bf16."""
    wire = _loopback(monkeypatch)
    ids, mask = torch.tensor([5, 0, 49151]), torch.tensor([False, True, True])
    aux, final = torch.arange(18.0).reshape(3, 6), -torch.arange(6.0).reshape(3, 2)
    T.send_sample(1, "ü-1", ids, mask, aux, final, seq_no=7, stats=(11, 22, 33, 44),
                  chunk_end=True, dropped_ids=("ab", "✓"))
    head, ints, feats = wire[0].tolist(), wire[1].tolist(), wire[2]
    id_bytes, dropped = list("ü-1".encode()), [2, 3, *b"ab", *"✓".encode()]
    assert head == [0x44464731, 1, 3, 6, 2, 1, len(id_bytes), 7, 11, 22, 33, 44, 1, 2, 5, 0]
    assert ints == [5, 0, 49151, 0, 1, 1, *id_bytes, *dropped]
    assert feats.dtype == torch.bfloat16 and torch.equal(feats, torch.cat([aux, final], 1).bfloat16())


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int16)


def _edge(length: int, mask: str, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 2**40, (length,), generator=gen)  # beyond any int32 vocabulary
    masks = {"none": torch.zeros(length, dtype=torch.bool), "all": torch.ones(length, dtype=torch.bool),
             "some": torch.rand(length, generator=gen) > 0.5}
    aux, final = torch.randn(length, 12, generator=gen) * 1e4, torch.randn(length, 4, generator=gen)
    # values bf16 must keep as they are: infinities, NaN, signed zero, its smallest subnormal
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    aux[0, :4] = special
    final[-1, 0] = torch.tensor(2.0**-133)
    return ids, masks[mask], aux, final


@pytest.mark.parametrize("length,mask,sample_id,dropped", [
    (1, "none", "", ("",)),  # one token, nothing supervised, empty id, an empty dropped id
    (1, "all", "x", ()),
    (2, "some", "conv-1#e3", ("a", "é" * 40)),
    (4096, "some", "long-✓", ()),  # the longest a default recipe allows (split.token_budget)
])
def test_edge_sizes_come_off_the_wire_bit_for_bit(monkeypatch, length, mask, sample_id, dropped):
    """Each field comes back exactly: ids as int64, the mask as bool, the features as the
    sender's values rounded once to bf16 (compared as bits, so NaN and -0.0 count)."""
    _loopback(monkeypatch)
    ids, loss_mask, aux, final = _edge(length, mask, seed=length)
    T.send_sample(1, sample_id, ids, loss_mask, aux, final, seq_no=length, dropped_ids=dropped)
    wire = T.recv_sample(0)
    assert (wire.sample_id, wire.dropped_ids, wire.seq_no) == (sample_id, dropped, length)
    assert wire.input_ids.dtype == torch.int64 and torch.equal(wire.input_ids, ids)
    assert wire.loss_mask.dtype == torch.bool and torch.equal(wire.loss_mask, loss_mask)
    assert int(wire.loss_mask.sum()) == int(loss_mask.sum())
    assert wire.aux.shape == (length, 12) and wire.final.shape == (length, 4)
    assert torch.equal(_bits(wire.aux), _bits(aux.to(torch.bfloat16)))
    assert torch.equal(_bits(wire.final), _bits(final.to(torch.bfloat16)))


# --------------------------------------------------------------------------- a dying target


def dying_target_worker(out: str) -> None:
    """Rank 0 (a target) sends two samples, then the header of a third, and dies before its
    body; rank 1 (a trainer) consumes through ConsumerStream and records what it met."""
    import datetime
    import time

    import torch.distributed as dist

    from draftforge.splitserve.consumer import ConsumerStream

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    acks = dist.new_group([0, 1], backend="gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    if rank == 0:
        T.AckListener([1], group=acks).result()
        for n in range(2):
            T.send_sample(1, f"s{n}", torch.arange(4), torch.ones(4, dtype=torch.bool),
                          torch.zeros(4, 2), torch.zeros(4, 2), seq_no=n)
        fields, dropped, _, _ = T.encode_sample("s2", torch.arange(4), torch.ones(4, dtype=torch.bool),
                                                torch.zeros(4, 2), torch.zeros(4, 2))
        dist.send(T._header(T.SAMPLE, [*fields, 2, 0, 0, 0, 0, 0, *dropped]), dst=1)
        time.sleep(0.5)
        os._exit(9)  # the target crashes inside a sample
    link = T.AckLink([0], group=acks, every_s=0.5)
    link.hello({})
    stream = ConsumerStream(T.SampleReceiver([0], credits=4), ack_group=acks, acks=link)
    result: dict = {"seen": []}
    try:
        for sample in stream.samples():
            result["seen"].append(sample.sample_id)
        result["outcome"] = "end of stream"
    except T.PeerDied as exc:
        result["outcome"], result["rank"] = str(exc), exc.rank
    Path(out).with_suffix(".1.json").write_text(json.dumps(result))
    os._exit(0)


@pytest.mark.distributed
def test_a_target_dying_inside_a_sample_stops_the_trainer_naming_it(tmp_path):
    """The trainer gets the two whole samples, then a PeerDied naming target rank 0 as dead
    (not silent) while it received the third's token ids, instead of waiting for it (the
    ranks are killed, and the test fails, if the trainer hangs)."""
    out = tmp_path / "dying"
    codes, logs = run_on_ranks(f"import test_wire_r11 as t; t.dying_target_worker({str(out)!r})", 2, 90)
    assert codes[1] == 0, logs[1]
    result = json.loads(out.with_suffix(".1.json").read_text())
    assert result["seen"] == ["s0", "s1"] and result["rank"] == 0
    assert result["outcome"].startswith("target rank 0 died or closed its connection")
    assert result["outcome"].endswith("(while receiving a sample's token ids)")


# --------------------------------------------------------------------------- packing


def _sample(i: int, length: int) -> Sample:
    return Sample(f"s{i}", torch.arange(length), torch.ones(length, dtype=torch.bool),
                  torch.zeros(length, 2), torch.zeros(length, 1))


@pytest.mark.parametrize("budget", [64, 100, 257])
def test_stream_packing_fills_each_batch_to_the_budget_in_order(budget):
    """Checked against the rule itself, not against ``pack``: the batches are the stream cut
    in order; each fits B * S_max <= budget unless it is one sample longer than the budget;
    each batch but the last is closed only because the next sample would not fit; the
    remainder is the last batch."""
    rng = random.Random(budget)
    lengths = [rng.randint(1, 60) for _ in range(80)]
    lengths[17] = lengths[18] = budget + 5  # longer than the budget, twice in a row
    lengths[-1] = budget  # the remainder: one sample exactly the budget long
    samples = [_sample(i, n) for i, n in enumerate(lengths)]
    batches = list(stream_pack(iter(samples), budget))
    assert [s.sample_id for b in batches for s in b] == [s.sample_id for s in samples]
    for batch, after in zip(batches, [*batches[1:], None], strict=True):
        padded = len(batch) * max(s.num_tokens for s in batch)
        assert padded <= budget or len(batch) == 1
        if after is not None:
            grown = (len(batch) + 1) * max(s.num_tokens for s in [*batch, after[0]])
            assert grown > budget
    long_ones = [b for b in batches if any(s.num_tokens > budget for s in b)]
    assert [[s.sample_id for s in b] for b in long_ones] == [["s17"], ["s18"]]
    assert [s.sample_id for s in batches[-1]] == ["s79"]


# --------------------------------------------------------------------------- accounting


def test_a_trainer_that_ran_no_step_reports_no_rate_and_no_advice():
    """Samples taken (120 tokens) but no step ran (the data ran out before a whole one): the
    trainer's wall time is zero. Its rate read 120 / 1e-9 = 1.2e11 tok/s, and the summary
    named a slower side and a split from nothing measured."""
    acc = ConsumerAccounting(world=2, num_target=1, credits=4)
    acc.on_producer_stats(0, {"busy_s": 2.0, "idle_s": 0.5, "wall_s": 4.0, "tokens": 300})
    acc.on_take(depth=1, tokens=120, waited_s=0.5)
    consumer = acc.snapshot()["consumer"]
    assert (consumer["wall_s"], consumer["tokens"], consumer["rate_tok_s"]) == (0.0, 120, 0.0)
    text = acc.summary_text()
    assert "120 tokens  0 tok/s  capacity 0 tok/s" in text
    assert "not measured (no training step)" in text and "recommended split for" not in text
    acc.on_step({"compute_s": 3.0, "wait_s": 0.0})  # one step: the advice comes back
    assert "recommended split for 2 ranks" in acc.summary_text()


def test_the_accounting_figures_follow_from_what_was_measured(monkeypatch):
    """Two producers feed one trainer of a 6-rank job with tensor-parallel pairs (4 target
    ranks, 2 producers). Every figure recomputed by hand from the readings, and the split
    from a brute-force search over the target ranks a pair at a time."""
    from draftforge.splitserve import accounting as A

    clock = [100.0]
    monkeypatch.setattr(A, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    acc = ConsumerAccounting(world=6, num_target=4, credits=6, num_sources=2, tensor_parallel=2)
    for depth, tokens, waited in ((1, 40, 0.5), (3, 60, 0.0), (6, 20, 0.0), (2, 80, 0.25)):
        clock[0] += 1.0
        acc.on_take(depth=depth, tokens=tokens, waited_s=waited)
    acc.on_producer_stats(0, {"busy_s": 6.0, "idle_s": 1.0, "wall_s": 10.0, "tokens": 600})
    acc.on_producer_stats(1, {"busy_s": 2.0, "idle_s": 3.0, "wall_s": 6.0, "tokens": 200})
    clock[0] = 108.0
    acc.on_step({"compute_s": 5.0, "wait_s": 2.0})
    s = acc.snapshot()
    p, c, q = s["producer"], s["consumer"], s["queue"]
    # producers: the mean of the two readings
    assert (p["busy_s"], p["idle_s"], p["wall_s"], p["tokens"]) == (4.0, 2.0, 8.0, 400)
    assert (p["busy_share"], p["idle_share"], p["rate_tok_s"], p["capacity_tok_s"]) == (0.5, 0.25, 50.0, 100.0)
    # the trainer: its step's compute and wait over the 8 s to the step's end, 200 tokens
    assert (c["busy_share"], c["idle_share"], c["rate_tok_s"], c["capacity_tok_s"]) == (5 / 8, 2 / 8, 25.0, 40.0)
    assert c["wire_wait_s"] == 0.75
    assert q == {"mean": 3.0, "max": 6, "credits": 6}
    best = max(((t, 6 - t, min(t // 2 * 100.0, (6 - t) * 40.0)) for t in (2, 4)),
               key=lambda x: (x[2], -x[0]))
    assert (s["recommended"]["target_ranks"], s["recommended"]["trainer_ranks"],
            s["recommended"]["expected_tok_s"]) == best == (2, 4, 100.0)
    # 2 producers x 100 against 2 trainers x 40: the trainers are the slower side
    assert "slower side: trainer; recommended split for 6 ranks: 2 target + 4 trainer" in acc.summary_text()


# --------------------------------------------------------------------------- order


class _FakeEngine:
    """Features that encode each token (so a sample's features show its tokens)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def features(self, ids, mask):
        value = ids.float()[..., None]
        return types.SimpleNamespace(aux=value.repeat(1, 1, 6), final=value.repeat(1, 1, 2))


def _streams(tmp_path: Path, consumed=None, budget: int = 192) -> tuple[dict, list, int]:
    from draftforge.config import load_recipe
    from draftforge.splitserve.producer import (
        SampleSource,
        build_topology,
        load_source_conversations,
    )
    from draftforge.splitserve.target import load_tokenizer

    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = load_recipe(tiny_recipe(tmp_path, num_conversations=23, overrides={
        "split.max_epochs": 3, "split.target_ranks": [0, 1], "split.trainer_ranks": [2, 3, 4],
        "train.strategy": "fsdp2", "target.generation.batch_size": 3,
        "split.token_budget": budget}))  # 192: 2 or 3 of these 61-81-token samples a micro-batch
    conversations, regenerate = load_source_conversations(cfg)
    engine = _FakeEngine(load_tokenizer(cfg.target))
    topology = build_topology(cfg.split)
    streams = {p: list(SampleSource(cfg, engine, topology, p, conversations=conversations,
                                    regenerate=regenerate, consumed=consumed).samples())
               for p in topology.producers}
    return streams, [c.id for c in conversations], cfg.target.generation.batch_size


def test_every_conversation_goes_to_one_trainer_once_an_epoch_and_resumes_in_place(tmp_path):
    """Two target ranks feed three trainers (0 -> 2 and 4, 1 -> 3) for three epochs: each
    conversation is one sample per epoch, named with its epoch, on one link; the same recipe
    gives the same streams; a resume with a prefix of each stream consumed gives the rest."""
    streams, ids, chunk = _streams(tmp_path)
    for epoch in range(3):
        names = [s.sample_id for stream in streams.values() for s in stream
                 if (s.sample_id.rsplit("#e", 1)[1] if "#e" in s.sample_id else "0") == str(epoch)]
        expected = [i if epoch == 0 else f"{i}#e{epoch}" for i in ids]
        assert sorted(names) == sorted(expected)
    assert {s.dest for s in streams[0]} == {2, 4} and {s.dest for s in streams[1]} == {3}
    for stream in streams.values():  # features are the sample's own tokens
        assert all(torch.equal(s.aux[:, 0].long(), s.input_ids) for s in stream)
    again, _, _ = _streams(tmp_path / "again")
    assert {p: [(s.sample_id, s.dest) for s in v] for p, v in again.items()} == \
        {p: [(s.sample_id, s.dest) for s in v] for p, v in streams.items()}
    links = {d: [s for stream in streams.values() for s in stream if s.dest == d] for d in (2, 3, 4)}
    cut = {2: 9, 3: 5, 4: 13}  # each trainer consumed its own prefix of its own link
    consumed = {s.sample_id: s.num_tokens for d, link in links.items() for s in link[: cut[d]]}
    resumed, _, _ = _streams(tmp_path / "resumed", consumed)
    for d, link in links.items():
        rest = [s for stream in resumed.values() for s in stream if s.dest == d]
        assert [s.sample_id for s in rest] == [s.sample_id for s in link[cut[d]:]], d
        assert all(torch.equal(a.aux, b.aux) for a, b in zip(rest, link[cut[d]:], strict=True))


@pytest.mark.parametrize("budget", [96, 192])
def test_a_producers_trainers_pack_micro_batches_in_step(tmp_path, budget):
    """Target rank 0 feeds trainers 2 and 4: each packs its link greedily to the token
    budget, and every step takes the same number of micro-batches from each, so at every
    point of the stream the two links' packed micro-batch counts differ by at most one."""
    from draftforge.splitserve.consumer import stream_pack

    streams, _, _ = _streams(tmp_path, budget=budget)
    for n in range(1, len(streams[0]) + 1):
        counts = [len(list(stream_pack([s for s in streams[0][:n] if s.dest == d], budget)))
                  for d in (2, 4)]
        assert abs(counts[0] - counts[1]) <= 1, (n, counts)
