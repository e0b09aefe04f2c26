"""``draftforge bench split``: the producer-alone phase is timed over whole chunks, and the
command runs the three phases of a real job and ends with its machine-readable line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from draftforge.config import load_recipe
from draftforge.splitserve.producer import (
    EPOCH_MARK,
    SampleSource,
    Topology,
    load_source_conversations,
    producer_alone,
)
from draftforge.splitserve.target import build_target

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-debug.yaml"


def _chunk_ids(cfg, engine, topology):
    conversations, regenerate = load_source_conversations(cfg)
    source = SampleSource(cfg, engine, topology, 0, conversations=conversations, regenerate=regenerate)
    return [{conversations[i].id for i in chunk} for chunk in source.chunks()]


def test_producer_alone_stops_at_a_chunk_boundary(tmp_path):
    cfg = load_recipe(TINY, [f"train.output_dir={tmp_path}", "data.num_samples=24",
                             "target.generation.batch_size=8"])
    engine = build_target(cfg.target, cfg.draft.target_layer_ids)
    topology = Topology([0], [1])
    chunks = _chunk_ids(cfg, engine, topology)
    # one token is enough after the first sample: the rest of its chunk still comes
    samples, tokens, seconds = producer_alone(cfg, engine, topology=topology, rank=0, min_tokens=1)
    assert {s.sample_id for s in samples} == chunks[0]
    assert tokens == sum(s.num_tokens for s in samples) and seconds > 0
    # one token more than a chunk holds: two whole chunks
    samples, two, _ = producer_alone(cfg, engine, topology=topology, rank=0, min_tokens=tokens + 1)
    assert {s.sample_id for s in samples} == chunks[0] | chunks[1]
    assert two > tokens
    # past the end of the epoch (3 chunks): the next epoch's chunks are whole chunks too
    epoch, epoch_tokens, _ = producer_alone(cfg, engine, topology=topology, rank=0, min_tokens=two + 1)
    assert {s.sample_id for s in epoch} == set().union(*chunks)
    samples, _, _ = producer_alone(cfg, engine, topology=topology, rank=0, min_tokens=epoch_tokens + 1)
    second = {s.sample_id.partition(EPOCH_MARK)[0] for s in samples
              if s.sample_id.endswith(f"{EPOCH_MARK}1")}
    assert second and len(samples) == len(epoch) + len(second)
    assert all(chunk <= second or not chunk & second for chunk in chunks)  # whole chunks only


@pytest.mark.integration
def test_bench_split_runs_the_three_phases(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "draftforge", "bench", "split", str(TINY), "--steps", "2",
         "data.num_samples=32", "target.generation.batch_size=8"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    for label in ("producer alone", "consumer alone", "both together"):
        assert any(line.startswith(label) and "tok/s" in line for line in lines), result.stdout
    fields = dict(item.split("=") for item in lines[-1].split())
    assert set(fields) == {"split_efficiency", "trainer_idle", "target_idle"}
    assert float(fields["split_efficiency"]) > 0
    assert all(0 <= float(fields[k]) <= 1 for k in ("trainer_idle", "target_idle"))
