"""Session 58: a chunk's regenerated answers are freed after its last visit.

``SampleSource`` kept every chunk's regenerated conversations until the stream ended, also in
a single-pass run (``split.max_epochs: 1``), where nothing reads them again: host memory grew
with the data set. A chunk's answers now go after its visit of the last epoch.
"""

from __future__ import annotations

import json

import pytest
import torch
from splitserve_helpers import tiny_recipe

from draftforge.config import load_recipe
from draftforge.splitserve.producer import SampleSource, build_topology, load_source_conversations
from draftforge.splitserve.target import build_target


def _stream(tmp_path, max_epochs: int, reuse: bool):
    """(sample ids in order, chunks whose answers were held as each sample was yielded, at the end)."""
    torch.set_num_threads(1)
    recipe = tiny_recipe(tmp_path, num_conversations=4, overrides={
        "data.regenerate": True, "split.max_epochs": max_epochs, "split.reuse_features": reuse,
        "target.generation.batch_size": 4, "target.generation.max_new_tokens": 8, "data.min_loss_tokens": 1})
    rows = [{"id": f"p{i:02d}", "messages": [{"role": "user", "content": f"Say something about {i}"}]}
            for i in range(16)]
    (tmp_path / "convs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_recipe(recipe)
    conversations, regenerate = load_source_conversations(cfg)
    assert regenerate
    engine = build_target(cfg.target, cfg.draft.target_layer_ids)
    source = SampleSource(cfg, engine, build_topology(cfg.split), 0, conversations=conversations,
                          regenerate=regenerate, log=lambda text: None)
    ids, held = [], []
    for sample in source.samples():
        ids.append(sample.sample_id)
        held.append(sorted(source._answers))
    return ids, held, sorted(source._answers)


@pytest.mark.integration
def test_a_single_pass_holds_only_the_chunk_in_hand(tmp_path):
    ids, held, end = _stream(tmp_path, max_epochs=1, reuse=False)
    assert len(ids) == 16 and end == []
    assert all(h == [] for h in held)  # freed before the chunk's samples leave


@pytest.mark.integration
@pytest.mark.parametrize("reuse", [False, True])
def test_two_epochs_free_a_chunk_after_its_second_visit(tmp_path, reuse):
    ids, held, end = _stream(tmp_path, max_epochs=2, reuse=reuse)
    assert len(ids) == 32 and end == []
    first = [i for i, sample in enumerate(ids) if sample.endswith("#e1")][0]
    # by the first epoch-1 sample, epoch 0 has regenerated some chunk whose answers epoch 1
    # still needs: held until that chunk's epoch-1 visit, gone by the end
    assert held[first - 1] != []
