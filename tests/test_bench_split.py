"""``draftforge bench split``: the producer-alone phase is timed over whole chunks, the
end-to-end phase chunk end to chunk end, and the command runs the three phases of a real
job and ends with its machine-readable line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from draftforge.config import load_recipe
from draftforge.splitserve.bench_split import (
    SteadyWindow,
    StepRecord,
    bench_result,
    merge_rank_values,
    producer_window,
    report,
    steady_rate,
)
from draftforge.splitserve.producer import (
    EPOCH_MARK,
    SampleSource,
    Topology,
    load_source_conversations,
)
from draftforge.splitserve.target import build_target

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-debug.yaml"


def _chunk_ids(cfg, engine, topology):
    conversations, regenerate = load_source_conversations(cfg)
    source = SampleSource(cfg, engine, topology, 0, conversations=conversations, regenerate=regenerate)
    return [{conversations[i].id for i in chunk} for chunk in source.chunks()]


def test_the_producer_window_stops_at_a_chunk_boundary(tmp_path):
    cfg = load_recipe(TINY, [f"train.output_dir={tmp_path}", "data.num_samples=24",
                             "target.generation.batch_size=8"])
    engine = build_target(cfg.target, cfg.draft.target_layer_ids)
    topology = Topology([0], [1])
    chunks = _chunk_ids(cfg, engine, topology)
    # the window opens after the first chunk; one token is enough in it: the rest of chunk 1 still comes
    samples, tokens, seconds = producer_window(cfg, engine, topology=topology, rank=0, min_tokens=1)
    assert {s.sample_id for s in samples} == chunks[0] | chunks[1]
    assert tokens == sum(s.num_tokens for s in samples if s.sample_id in chunks[1]) and seconds > 0
    # one token more than chunk 1 holds: chunks 1 and 2 in the window
    samples, two, _ = producer_window(cfg, engine, topology=topology, rank=0, min_tokens=tokens + 1)
    assert {s.sample_id for s in samples} == set().union(*chunks)
    assert two > tokens
    # past the end of the epoch (3 chunks): the next epoch's chunks are whole chunks too
    samples, _, _ = producer_window(cfg, engine, topology=topology, rank=0, min_tokens=two + 1)
    second = {s.sample_id.partition(EPOCH_MARK)[0] for s in samples
              if s.sample_id.endswith(f"{EPOCH_MARK}1")}
    assert second and len(samples) == sum(map(len, chunks)) + len(second)
    assert all(chunk <= second or not chunk & second for chunk in chunks)  # whole chunks only


class _CountingEngine:
    """The target engine, counting the rows it featurises."""

    def __init__(self, engine):
        self.engine, self.rows = engine, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def features(self, input_ids, attention_mask=None):
        self.rows += int(input_ids.shape[0])
        return self.engine.features(input_ids, attention_mask)


def test_the_producer_window_computes_nothing_past_its_last_chunk(tmp_path):
    """It used to featurise the whole next chunk to see that the last one had ended: phase 1
    spent a chunk's wall time more than it timed, and its log parts covered that work too."""
    cfg = load_recipe(TINY, [f"train.output_dir={tmp_path}", "data.num_samples=24",
                             "target.generation.batch_size=8", "split.feature_batch_size=2"])
    engine = _CountingEngine(build_target(cfg.target, cfg.draft.target_layer_ids))
    topology = Topology([0], [1])
    chunks = _chunk_ids(cfg, engine, topology)
    engine.rows = 0
    samples, first, _ = producer_window(cfg, engine, topology=topology, rank=0, min_tokens=1)
    assert {s.sample_id for s in samples} == chunks[0] | chunks[1]
    assert engine.rows == len(samples) == len(chunks[0]) + len(chunks[1])
    engine.rows = 0  # one token more than the window's first chunk holds: three chunks, not four
    samples, _, _ = producer_window(cfg, engine, topology=topology, rank=0, min_tokens=first + 1)
    assert {s.sample_id for s in samples} == set().union(*chunks)
    assert engine.rows == len(samples) == sum(map(len, chunks))


def test_every_chunk_marks_its_last_sample_on_each_link(tmp_path):
    cfg = load_recipe(TINY, [f"train.output_dir={tmp_path}", "data.num_samples=24",
                             "target.generation.batch_size=8", "split.target_ranks=[0]",
                             "split.trainer_ranks=[1,2]"])
    engine = build_target(cfg.target, cfg.draft.target_layer_ids)
    topology = Topology([0], [1, 2])
    chunks = _chunk_ids(cfg, engine, topology)
    conversations, regenerate = load_source_conversations(cfg)
    source = SampleSource(cfg, engine, topology, 0, conversations=conversations,
                          regenerate=regenerate)
    stream = iter(source.samples())
    for chunk in chunks:
        samples = [next(stream) for _ in chunk]  # tiny-debug drops no sample
        assert {s.sample_id for s in samples} == chunk
        for dest in (1, 2):
            mine = [s.chunk_end for s in samples if s.dest == dest]
            assert mine and mine[-1] and sum(mine) == 1, (dest, mine)


def _step(end_s, *samples, wait_s=0.0, producer=(0.0, 0.0)):
    """A step taking ``samples``, each (source rank, tokens, chunk_end), all of epoch 0."""
    return StepRecord(end_s, [(*sample, 0) for sample in samples], wait_s, producer)


def test_the_steady_rate_runs_from_the_first_chunk_end_to_the_last():
    # one link, 10 tokens a sample: chunk ends in steps 1, 3 and 4. The window runs from
    # the end of step 1 (5 s) to the end of step 4 (11 s) and counts what steps 2-4 trained:
    # 70 tokens (the sample after the last chunk end in step 4 too: the 6 s include its
    # training, as the step after the first chunk end's excludes what step 1 trained after it).
    # The trainer waited 3 s before the window (the fill) and 1.5 s inside it.
    records = [
        _step(4.0, (0, 10, False), (0, 10, False), wait_s=3.0),
        _step(5.0, (0, 10, True), wait_s=3.0),
        _step(7.0, (0, 10, False), (0, 10, False), wait_s=3.5),
        _step(10.0, (0, 10, True), (0, 10, False), (0, 10, False), wait_s=4.5),
        _step(11.0, (0, 10, True), (0, 10, False), wait_s=4.5),
    ]
    assert steady_rate(records, min_chunks=2) == SteadyWindow(70 / 6.0, 2, 1.5 / 6.0, 0.0)
    assert steady_rate(records, min_chunks=3) is None  # too few chunks to average over
    # what the first chunk end's step trains after it was trained before the window
    records[1] = _step(5.0, (0, 10, True), (0, 99, False), wait_s=3.0)
    assert steady_rate(records, min_chunks=2) == SteadyWindow(70 / 6.0, 2, 1.5 / 6.0, 0.0)
    # the target's idle share over the same steps: the producers' (idle, wall) readings at
    # the window's two ends. Before it the target never waited (the fill): 0 of 4 s idle;
    # inside it, 3 of 6 s. Over the whole phase that would read 3 of 10.
    readings = [(0.0, 3.5), (0.0, 4.0), (1.0, 6.0), (2.5, 9.0), (3.0, 10.0)]
    records = [StepRecord(r.end_s, r.samples, r.wait_s, p) for r, p in zip(records, readings, strict=True)]
    assert steady_rate(records, min_chunks=2).target_idle == 3.0 / 6.0
    # two links (two target ranks feeding this trainer): each link's own window, rates summed
    records = [
        _step(1.0, (0, 10, True), (5, 1, True)),
        _step(2.0, (0, 20, False), (5, 2, False)),
        _step(4.0, (0, 30, True), (5, 3, True)),
    ]
    assert steady_rate(records, min_chunks=1) == SteadyWindow(50 / 3.0 + 5 / 3.0, 2, 0.0, 0.0)
    # a link with a single chunk end, or two in the same step: no steady window
    assert steady_rate([_step(1.0, (0, 10, True)), _step(2.0, (0, 10, False))], min_chunks=1) is None
    assert steady_rate([_step(1.0, (0, 10, True), (0, 10, True))], min_chunks=1) is None
    assert steady_rate([], min_chunks=1) is None


def _all_reduce(*ranks):
    """What the trainer ranks' two all_reduce calls (SUM, MAX) hand every rank."""
    return [sum(v) for v in zip(*ranks, strict=True)], [max(v) for v in zip(*ranks, strict=True)]


def test_two_trainer_ranks_combine_into_the_ratio_against_the_slower_side():
    # (prod tokens, prod wall, cons tokens, cons wall, both tokens, both wall, trainer wait,
    #  target idle, steady tok/s, steady chunks, no steady, steady trainer idle). The producer
    # is counted on its first destination only: rank 2 saw no producer tokens.
    rank1 = [600.0, 2.0, 800.0, 1.0, 300.0, 2.5, 0.5, 0.1, 120.0, 5.0, 0.0, 0.25]
    rank2 = [0.0, 0.0, 1000.0, 2.0, 300.0, 3.0, 1.5, 0.3, 150.0, 4.0, 0.0, 0.75]
    merged = merge_rank_values(*_all_reduce(rank1, rank2))
    # tokens and rates add up; walls and the trainer's wait and idle share are the worst rank's
    # (in lockstep, rank 1 waits in the gradient reduction while rank 2 waits for samples)
    assert merged == [600.0, 2.0, 1800.0, 2.0, 600.0, 3.0, 1.5, 0.3, 270.0, 9.0, 0.0, 0.75]
    result = bench_result(7, merged)
    assert result == pytest.approx({
        "steps": 7, "producer_tok_s": 300.0, "consumer_tok_s": 900.0,
        "from_empty_tok_s": 200.0, "steady_tok_s": 270.0, "steady_chunks": 9,
        "from_empty_trainer_idle": 0.5, "steady_trainer_idle": 0.75, "target_idle": 0.3,
        "from_empty_efficiency": 200.0 / 300.0, "end_to_end_tok_s": 270.0,
        "split_efficiency": 0.9, "trainer_idle": 0.75,
    })  # fmt: skip
    # rank 2 found no steady window: the ratio falls back to the from-empty rate; and with the
    # producer now the faster side (600 tok/s), it is taken against the consumers' 300
    rank1[0], rank1[2], rank1[3] = 1200.0, 200.0, 2.0
    rank2[2], rank2[10] = 400.0, 1.0
    result = bench_result(7, merge_rank_values(*_all_reduce(rank1, rank2)))
    assert (result["producer_tok_s"], result["consumer_tok_s"]) == (600.0, 300.0)
    assert result["steady_tok_s"] is None and result["end_to_end_tok_s"] == 200.0
    assert result["split_efficiency"] == result["from_empty_efficiency"] == pytest.approx(200.0 / 300.0)
    assert result["trainer_idle"] == result["from_empty_trainer_idle"] == pytest.approx(0.5)
    # a single trainer rank: its own values
    single = bench_result(3, [400.0, 2.0, 500.0, 1.0, 300.0, 2.0, 0.5, 0.2, 180.0, 4.0, 0.0, 0.25])
    assert (single["producer_tok_s"], single["consumer_tok_s"], single["steady_tok_s"]) == (200.0, 500.0, 180.0)
    assert single["split_efficiency"] == pytest.approx(0.9) and single["trainer_idle"] == 0.25
    assert single["from_empty_efficiency"] == pytest.approx(150.0 / 200.0)


def test_the_report_says_which_rate_the_ratio_uses():
    result = {"steps": 40, "producer_tok_s": 200.0, "consumer_tok_s": 800.0,
              "from_empty_tok_s": 176.0, "steady_tok_s": 190.0, "steady_chunks": 9,
              "from_empty_efficiency": 0.88, "end_to_end_tok_s": 190.0,
              "split_efficiency": 0.95, "trainer_idle": 0.75, "steady_trainer_idle": 0.75,
              "from_empty_trainer_idle": 0.78, "target_idle": 0.0}
    text = report(result)
    assert "both together, steady" in text and "(steady)" in text
    assert text.splitlines()[-1] == "split_efficiency=0.950 trainer_idle=0.750 target_idle=0.000"
    text = report(result | {"steady_tok_s": None, "split_efficiency": 0.88})
    assert "both together, steady" not in text and "no steady window" in text


PEER_TIMEOUT_S = 1.5  # split.peer_timeout_s of the run below: each phase outlasts it


@pytest.mark.distributed
@pytest.mark.integration
def test_bench_split_runs_the_three_phases_each_longer_than_the_peer_timeout(tmp_path):
    """The three phases of a real job, with their figures and last line. Each phase outlasts
    split.peer_timeout_s: phase 1 ran with the target's heartbeat closed and phase 2 with no
    trainer heartbeat, so the trainer died waiting for phase 1's rate (named 'the target's
    embeddings'), or the target waiting for phase 3, once a phase outlasted the timeout."""
    result = subprocess.run(
        [sys.executable, "-m", "draftforge", "bench", "split", str(TINY), "--steps", "3",
         "data.num_samples=64", "target.generation.batch_size=8", f"split.peer_timeout_s={PEER_TIMEOUT_S}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # both phases outlasted the timeout (else this run proves nothing of liveness)
    phase_1 = re.search(r"\[rank 0 target\]\s+\d+ tokens in ([0-9.]+) s", result.stderr)
    phase_2 = re.search(r"\[rank 1 trainer\]\s+\d+ tokens in ([0-9.]+) s", result.stderr)
    assert phase_1 and phase_2, result.stderr[-3000:]
    assert float(phase_1.group(1)) > PEER_TIMEOUT_S and float(phase_2.group(1)) > PEER_TIMEOUT_S, result.stderr
    lines = result.stdout.strip().splitlines()
    for label in ("producer alone", "consumer alone", "both together"):
        assert any(line.startswith(label) and "tok/s" in line for line in lines), result.stdout
    assert any(line.startswith("both together, from empty") for line in lines)
    ratio = next(line for line in lines if line.startswith("end-to-end / min"))
    assert ratio.endswith("(steady)") or "no steady window" in ratio, ratio

    def rate(label):  # printed with one decimal
        line = next(line for line in lines if line.startswith(label))
        return float(re.search(r":\s*([0-9.]+) tok/s", line).group(1))

    producer, consumer = rate("producer alone"), rate("consumer alone")
    end_to_end = rate("both together, steady" if ratio.endswith("(steady)") else "both together, from empty")
    printed = float(re.search(r"= ([0-9.]+)", ratio).group(1))
    slower = min(producer, consumer)
    assert slower > 0.05, result.stdout
    # the printed ratio (3 decimals) against the one the printed rates (1 decimal) allow
    low, high = (end_to_end - 0.05) / (slower + 0.05), (end_to_end + 0.05) / (slower - 0.05)
    assert low - 5e-4 <= printed <= high + 5e-4, (printed, end_to_end, producer, consumer)
    fields = dict(item.split("=") for item in lines[-1].split())
    assert set(fields) == {"split_efficiency", "trainer_idle", "target_idle"}
    assert float(fields["split_efficiency"]) > 0
    assert all(0 <= float(fields[k]) <= 1 for k in ("trainer_idle", "target_idle"))


def test_a_stream_that_ends_before_phase_3_is_done_says_so():
    """split.max_epochs can end the data before phase 3's steps: the rank used to die with a
    bare StopIteration from inside a list comprehension."""
    from draftforge.errors import InputError
    from draftforge.splitserve.bench_split import _recorded_steps

    class Trainer:
        steps = 0

        def train_step(self, micro):
            self.steps += 1

    trainer = Trainer()
    with pytest.raises(InputError) as err:
        _recorded_steps(trainer, iter([[], [], []]), steps=3, grad_accum=2)
    assert trainer.steps == 1
    assert str(err.value) == (
        "bench split: the data ended after 1 of the 3 steps phase 3 needs (split.max_epochs, or "
        "too few samples); add data, drop split.max_epochs or lower --steps")
