"""SplitServe's producer sends each sample its own features.

The producer pads a feature batch of samples of different lengths into one ``[B, S]`` forward
of the target and slices each sample's rows back out; a slice taken on the wrong side of the
padding hands a sample features of pad positions and of a shifted sequence, which trains the
draft on garbage without any error. Here every produced sample's ``aux`` and ``final`` are
compared with the target run on that sample alone (batch of one, no padding).
"""

from __future__ import annotations

import torch
from splitserve_helpers import tiny_recipe

from draftforge.config import load_recipe
from draftforge.data.tokenize import tokenize_conversations
from draftforge.splitserve.producer import SampleSource, build_topology, load_source_conversations
from draftforge.splitserve.target import build_target

# The tiny target runs in float32. A sample alone and the same sample in a padded batch give the
# same features up to float32 rounding of differently ordered reductions (~1e-6 here); the wire
# then rounds to bf16, whose relative step is 2**-8 = 0.4%, so a difference below 1e-4 cannot
# change what a trainer receives by more than one bf16 rounding. A misaligned slice is off by
# 0.1 and more (the tiny random target's features are of order 1).
ATOL, RTOL = 1e-4, 1e-4


class RecordingEngine:
    """The real target engine, recording the attention masks of its feature batches."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.masks: list[torch.Tensor] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def features(self, input_ids, attention_mask=None):
        self.masks.append(attention_mask.clone())
        return self.engine.features(input_ids, attention_mask)


def test_every_produced_sample_carries_the_features_of_its_own_tokens(tmp_path):
    cfg = load_recipe(tiny_recipe(tmp_path, num_conversations=10, overrides={
        "target.generation.batch_size": 7, "split.feature_batch_size": 3, "split.max_epochs": 1}))
    engine = build_target(cfg.target, cfg.draft.target_layer_ids)
    recording = RecordingEngine(engine)
    conversations, regenerate = load_source_conversations(cfg)
    assert not regenerate
    source = SampleSource(cfg, recording, build_topology(cfg.split), 0,
                          conversations=conversations, regenerate=False)  # fmt: skip
    samples = list(source.samples())

    tokenized, _ = tokenize_conversations(
        conversations, engine.tokenizer, max_length=cfg.data.max_length,
        min_loss_tokens=cfg.data.min_loss_tokens, chat_template=cfg.target.generation.chat_template,
        enable_thinking=cfg.target.generation.enable_thinking,
    )  # fmt: skip
    expected_ids = {t.id: t.input_ids for t in tokenized}
    assert sorted(s.sample_id for s in samples) == sorted(expected_ids)
    # batches of more than one sample, of different lengths: some rows were padded
    padded_batches = [m for m in recording.masks if m.shape[0] > 1 and len(set(m.sum(dim=1).tolist())) > 1]
    assert len(padded_batches) >= 2, [m.sum(dim=1).tolist() for m in recording.masks]

    for sample in samples:
        ids = expected_ids[sample.sample_id]
        assert sample.input_ids.tolist() == ids, sample.sample_id
        alone = engine.features(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
        assert sample.aux.shape == alone.aux[0].shape and sample.final.shape == alone.final[0].shape
        for name, got, want in (("aux", sample.aux, alone.aux[0]), ("final", sample.final, alone.final[0])):
            worst = (got.float() - want.float()).abs().max().item()
            assert torch.allclose(got.float(), want.float(), atol=ATOL, rtol=RTOL), (
                f"{sample.sample_id}: {name} differs from the target run on the sample alone "
                f"(largest difference {worst:.3g})")
