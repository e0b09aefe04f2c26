"""What a target rank holds while it computes the next chunk (review round 61): the samples
of the visit just sent stayed referenced, features and all, until the next chunk's were
ready; and after a resume that had consumed a chunk's last-epoch samples but not all of its
first-epoch ones, the answers regenerated for that first epoch were never let go."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from splitserve_helpers import tiny_recipe

from draftforge.config import load_recipe
from draftforge.splitserve.producer import (
    ProducedSample,
    SampleSource,
    build_topology,
    epoch_id,
    id_epoch,
    load_source_conversations,
)
from draftforge.splitserve.target import build_target


def _source(cfg, engine, consumed=None) -> SampleSource:
    conversations, regenerate = load_source_conversations(cfg)
    return SampleSource(cfg, engine, build_topology(cfg.split), 0, conversations=conversations,
                        regenerate=regenerate, consumed=consumed, log=lambda text: None)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # isinstance over every live object touches torch.distributed.reduce_op
@pytest.mark.parametrize("reuse", [False, True])
def test_a_sent_visits_samples_are_not_held_while_the_next_chunk_is_computed(tmp_path, reuse):
    cfg = load_recipe(tiny_recipe(tmp_path, num_conversations=24, overrides={
        "target.generation.batch_size": 8, "split.feature_batch_size": 8, "split.max_epochs": 2,
        "split.reuse_features": reuse, "data.min_loss_tokens": 1}))
    target = build_target(cfg.target, cfg.draft.target_layer_ids)
    held: list[list[str]] = []

    class Counting:
        """The target, noting the producer's samples alive whenever features are computed."""

        def __getattr__(self, name):
            return getattr(target, name)

        def features(self, *args, **kwargs):
            gc.collect()
            held.append([o.sample_id for o in gc.get_objects() if isinstance(o, ProducedSample)])
            return target.features(*args, **kwargs)

    sent = 0
    for sample in _source(cfg, Counting()).samples():  # a consumer that lets each go at once
        sent += 1
        del sample
    # every feature call after the first chunk's came when earlier samples had been sent
    assert sent == 48 and len(held) >= 3
    assert held == [[]] * len(held)


def test_answers_are_let_go_at_a_chunks_last_visit_even_when_a_resume_skips_it(tmp_path):
    """Two epochs over answers regenerated on the fly. The resume has consumed chunk 0's
    epoch-1 samples but not its epoch-0 ones (two trainers, the one with the epoch-0 samples
    behind): the epoch-0 visit regenerates the answers, and the skipped last visit drops them."""
    recipe = tiny_recipe(tmp_path, trainers=2, num_conversations=4, overrides={
        "data.regenerate": True, "split.max_epochs": 2, "split.reuse_features": True,
        "target.generation.batch_size": 4, "target.generation.max_new_tokens": 8, "data.min_loss_tokens": 1,
        "split.feature_batch_size": 4})
    rows = [{"id": f"p{i:02d}", "messages": [{"role": "user", "content": f"Say something about {i}"}]}
            for i in range(8)]
    (tmp_path / "convs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_recipe(recipe)
    torch.manual_seed(0)
    target = build_target(cfg.target, cfg.draft.target_layer_ids)
    whole = _source(cfg, target)
    reference = list(whole.samples())
    assert whole._answers == {}  # an uninterrupted run lets every chunk's answers go
    chunk = next(ids for ids in whole_chunks(whole) if reference[0].sample_id in ids)  # the first visited
    epoch1 = {s.sample_id: s.num_tokens for s in reference if id_epoch(s.sample_id) == 1
              and any(s.sample_id == epoch_id(conv, 1) for conv in chunk)}
    assert len(epoch1) == len(chunk)
    resumed = _source(cfg, target, consumed=epoch1)
    again = list(resumed.samples())
    assert [s.sample_id for s in again] == [s.sample_id for s in reference if s.sample_id not in epoch1]
    assert resumed._answers == {}


def whole_chunks(source: SampleSource) -> list[list[str]]:
    """The conversation ids of each of the source's chunks."""
    return [[source.conversations[i].id for i in chunk] for chunk in source.chunks()]
