"""split.reuse_features: the target computes a sample's features once for epochs 0 and 1.

Each chunk's epoch-1 visit comes right after the next chunk's epoch-0 visit and sends the
features epoch 0 computed. Checked here against the stream without the option: the same
samples, bit for bit, in the interleaved order, with no feature batch computed for epoch 1;
and a resumed stream that must compute again what epoch 0 did not keep gives the same."""

from __future__ import annotations

import pytest
import torch
from splitserve_helpers import tiny_recipe

from draftforge.splitserve.producer import epoch_order, epoch_rounds

EPOCH_MARK_1 = "#e1"


def test_rounds_interleave_epochs_0_and_1_and_keep_later_epochs_as_they_were():
    rounds = epoch_rounds(3, seed=5, max_epochs=4, interleave=True)
    assert next(rounds) == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (0, 2, 3), (1, 1, 4), (1, 2, 5)]
    for epoch in (2, 3):  # as without the option: the seeded order, rotations after the first round
        assert next(rounds) == [(epoch, c, epoch * 3 + step)
                                for step, c in enumerate(epoch_order(3, seed=5, epoch=epoch))]
    assert next(rounds, None) is None
    plain = epoch_rounds(3, seed=5, max_epochs=2, interleave=False)
    assert list(plain) == [[(0, 0, 0), (0, 1, 1), (0, 2, 2)],
                           [(1, c, 3 + step) for step, c in enumerate(epoch_order(3, seed=5, epoch=1))]]


@pytest.mark.parametrize("chunks, max_epochs, want", [
    (1, None, [(0, 0, 0), (1, 0, 1)]),
    (2, 2, [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]),
    (2, 1, [(0, 0, 0), (0, 1, 1)]),  # one epoch: nothing to send again
])
def test_rounds_at_the_edges(chunks, max_epochs, want):
    assert next(epoch_rounds(chunks, seed=0, max_epochs=max_epochs, interleave=True)) == want
    if max_epochs is not None:
        assert len(list(epoch_rounds(chunks, seed=0, max_epochs=max_epochs, interleave=True))) == 1


class CountingEngine:
    """The real tiny target, counting the rows of its feature batches."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.rows = 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def features(self, input_ids, attention_mask=None):
        self.rows += input_ids.shape[0]
        return self.engine.features(input_ids, attention_mask)


def _stream(tmp_path, *, reuse: bool, consumed=None, stop_after: int | None = None):
    from draftforge.config import load_recipe
    from draftforge.splitserve.producer import (
        SampleSource,
        build_topology,
        load_source_conversations,
    )
    from draftforge.splitserve.target import build_target

    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = load_recipe(tiny_recipe(tmp_path, num_conversations=14, overrides={
        "target.generation.batch_size": 4, "split.feature_batch_size": 3, "split.max_epochs": 3,
        "split.reuse_features": reuse}))
    conversations, regenerate = load_source_conversations(cfg)
    engine = CountingEngine(build_target(cfg.target, cfg.draft.target_layer_ids))
    source = SampleSource(cfg, engine, build_topology(cfg.split), 0, conversations=conversations,
                          regenerate=regenerate, consumed=consumed, log=lambda text: None,
                          should_stop=lambda: stop_after is not None and engine.rows >= stop_after)
    return list(source.samples()), engine.rows, source


def _epoch(sample_id: str) -> int:
    return int(sample_id.rpartition("#e")[2]) if "#e" in sample_id else 0


def _same(a, b) -> None:
    assert a.sample_id == b.sample_id
    for name in ("input_ids", "loss_mask", "aux", "final"):
        assert torch.equal(getattr(a, name), getattr(b, name)), (a.sample_id, name)


def test_reused_features_are_the_ones_a_second_forward_gives_and_epoch_1_computes_none(tmp_path):
    plain, plain_rows, _ = _stream(tmp_path / "plain", reuse=False)
    reused, reused_rows, source = _stream(tmp_path / "reuse", reuse=True)
    by_id = {s.sample_id: s for s in plain}
    assert sorted(by_id) == sorted(s.sample_id for s in reused)
    for sample in reused:
        _same(sample, by_id[sample.sample_id])
    per_epoch = [sum(1 for s in plain if _epoch(s.sample_id) == e) for e in range(3)]
    assert per_epoch[0] == per_epoch[1] == per_epoch[2] > 8
    assert plain_rows == sum(per_epoch)  # every epoch computed
    assert reused_rows == per_epoch[0] + per_epoch[2]  # epoch 1 sent what epoch 0 computed
    assert not source._kept  # nothing is held once epoch 1 has sent it
    # the interleaved order: chunk 0's epoch-1 samples follow chunk 1's epoch-0 ones, and epoch 2
    # comes after both
    epochs = [_epoch(s.sample_id) for s in reused]
    first_e1, last_e0 = epochs.index(1), len(epochs) - 1 - epochs[::-1].index(0)
    assert 4 <= first_e1 < last_e0, epochs
    assert epochs[: first_e1] == [0] * first_e1 and epochs.index(2) > len(epochs) - 1 - epochs[::-1].index(1)
    assert [s.sample_id for s in reused[first_e1 : first_e1 + 4]] == [
        f"{s.sample_id}{EPOCH_MARK_1}" for s in reused[:4]]


@pytest.mark.parametrize("cut", [5, 9, 13])
def test_a_resumed_stream_computes_again_what_epoch_0_did_not_keep_and_sends_the_same(tmp_path, cut):
    """A resume whose trainers consumed the first ``cut`` samples: the epoch-0 feature batches
    they consumed are not computed again in epoch 0, so epoch 1 computes them itself."""
    reference, reference_rows, _ = _stream(tmp_path / "reference", reuse=True)
    consumed = {s.sample_id: s.num_tokens for s in reference[:cut]}
    for sample in reference[:cut]:
        consumed.update(dict.fromkeys(sample.dropped_ids, 0))
    resumed, rows, source = _stream(tmp_path / "resumed", reuse=True, consumed=consumed)
    assert len(resumed) == len(reference) - cut
    for got, want in zip(resumed, reference[cut:], strict=True):
        _same(got, want)
    assert rows > 0 and not source._kept


@pytest.mark.parametrize("overrides, kept", [
    (["split.reuse_features=true"], True),
    (["split.reuse_features=true", "split.max_epochs=1"], False),  # no epoch 1 to send them to
    (["split.reuse_features=false"], False),
])
def test_the_dry_run_counts_the_kept_features_on_the_target(overrides, kept):
    from pathlib import Path

    from draftforge.config import load_recipe
    from draftforge.splitserve.dry_run import target_estimate

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-cpu.yaml"
    cfg = load_recipe(recipe, overrides)
    items = dict(target_estimate(cfg).items)
    name = "features kept for epoch 1 (split.reuse_features: two chunks)"
    assert (name in items) == kept, items
    if kept:  # two chunks of 64 rows of 320 tokens, 5 layers and the final state of 576, bf16
        assert items[name] == 2 * 64 * 320 * 6 * 576 * 2


@pytest.mark.parametrize("overrides, said", [
    ([], None),  # the recipe's 128 credits hold two chunks of 64
    (["split.max_in_flight=64"], "split.max_in_flight 64 holds less of them than trainer rank(s) [1] get, "
                                 "so a target rank waits for a trainer to take some before it answers its "
                                 "next chunk: raise it to 128"),
    # two trainers share a chunk: 64 samples of the two chunks each
    (["split.trainer_ranks=[1,2]", "train.strategy=fsdp2", "split.max_in_flight=32"],
     "split.max_in_flight 32 holds less of them than trainer rank(s) [1, 2] get, so a target rank waits "
     "for a trainer to take some before it answers its next chunk: raise it to 64"),
    (["split.trainer_ranks=[1,2]", "train.strategy=fsdp2", "split.max_in_flight=64"], None),
])
def test_the_dry_run_says_what_reuse_does_and_when_the_credits_are_short(overrides, said):
    from pathlib import Path

    from draftforge.config import load_recipe
    from draftforge.splitserve.dry_run import dry_run

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-cpu.yaml"
    text = dry_run(load_recipe(recipe, overrides))
    assert ("split.reuse_features: epochs 0 and 1 interleave chunk by chunk, epoch 1 sending the features "
            "epoch 0 computed, so a target rank sends two chunks (128 samples) for each chunk it answers") in text
    assert (said in text) if said else ("holds less of them" not in text), text
    assert "split.reuse_features" not in dry_run(load_recipe(recipe, ["split.reuse_features=false"]))


def test_a_stream_the_trainers_stop_holds_no_kept_features(tmp_path):
    """The trainers have their steps: the target rank still sends the links' last samples and
    waits for the stops, without a chunk's features held on its device meanwhile."""
    samples, rows, source = _stream(tmp_path, reuse=True, stop_after=6)
    assert 0 < len(samples) < 14 and rows >= 6  # stopped inside epoch 0, with batches kept
    assert not source._kept
