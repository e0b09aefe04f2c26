"""Round 11 of the objective's review: the whole training forward (collate, anchors, packed
blocks, objective) of a right-padded batch of multi-turn samples against an independent
per-sample, per-block computation, and batches with nothing to supervise."""

from __future__ import annotations

import math

import pytest
import torch
from dspark_helpers import tiny_draft

from draftforge.train.blocks import sample_anchors
from draftforge.train.sample import Sample, collate

DECAY = 4.0
CE_W, TV_W, BCE_W = 0.1, 0.9, 1.0


def _sample(name: str, mask: list[int], cfg, gen: torch.Generator) -> Sample:
    length = len(mask)
    return Sample(
        name,
        torch.randint(0, cfg.vocab_size, (length,), generator=gen),
        torch.tensor(mask, dtype=torch.bool),
        torch.randn(length, cfg.num_context_features, generator=gen),
        torch.randn(length, cfg.target_hidden_size, generator=gen),
    )


def _block_terms(model, sample: Sample, p: int) -> list[tuple[float, float, float, float, float]]:
    """(w, ce, tv, bce, c*) of each supervised slot of the block at ``p``, from this sample alone:
    per-block inference (context strictly before p), teacher-forced Markov loop, the contract's
    formulas in float64."""
    ids, mask, length = sample.input_ids, sample.loss_mask, sample.num_tokens
    gamma = model.config.block_size
    with torch.no_grad():
        hidden = model.block_forward(ids[p : p + 1], p, sample.aux[None, :p])
        truth = [int(ids[min(p + k + 1, length - 1)]) for k in range(gamma)]
        _, logits, conf = model.draft_block(hidden, ids[p : p + 1],
                                            sample=lambda _l, k: torch.tensor([truth[k]]))
    terms = []
    for k in range(gamma):
        if p + k + 1 >= length or not mask[p + k + 1]:
            break  # this slot and every later one are unsupervised
        log_pd = torch.log_softmax(logits[0, k].double(), -1)
        p_t = torch.softmax((model.lm_head.weight.double() @ sample.final[p + k].double()), -1)
        tv = float((log_pd.exp() - p_t).abs().sum())
        c = min(max(1.0 - 0.5 * tv, 0.0), 1.0)
        z = float(conf[0, k])
        bce = -(c * math.log(1 / (1 + math.exp(-z))) + (1 - c) * math.log(1 - 1 / (1 + math.exp(-z))))
        terms.append((math.exp(-k / DECAY), -float(log_pd[truth[k]]), tv, bce, c))
    return terms


@pytest.mark.parametrize("head_type", ["vanilla", "rnn"])
def test_a_padded_batch_of_multi_turn_samples_trains_as_each_block_alone(head_type):
    """Samples of different lengths (one shorter than a block), with a user turn between two
    answers, right-padded into one batch: the loss, its parts, c* and the validity of every slot
    equal what each sample's blocks give on their own. A block sees nothing of the padding or
    of another row, and no slot is supervised across the unsupervised turn or the sample's end."""
    model = tiny_draft(markov_head_type=head_type).eval()
    cfg = model.config
    gen = torch.Generator().manual_seed(11)
    masks = [
        [0] * 4 + [1] * 6 + [0] * 2 + [1] * 9,  # answer, user turn (shorter than a block), answer
        [0] * 2 + [1] * 3 + [0] * 3 + [1] * 4,  # shorter: padded by 12
        [0, 1, 1],  # shorter than a block (γ = 4): one anchor, one slot
    ]
    samples = [_sample(f"s{i}", m, cfg, gen) for i, m in enumerate(masks)]
    batch = collate(samples)
    anchors, anchor_valid = sample_anchors(batch.loss_mask, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(batch.input_ids, batch.loss_mask, batch.aux, batch.final, anchors, anchor_valid)
    gamma = cfg.block_size
    c_star = out.c_star.view(len(samples), -1, gamma)
    valid = out.valid.view(len(samples), -1, gamma)
    sums = [0.0] * 4
    den = 0.0
    blocks = 0
    for row, sample in enumerate(samples):
        for a in range(anchors.shape[1]):
            if not anchor_valid[row, a]:
                assert not valid[row, a].any()
                continue
            p = int(anchors[row, a])
            assert sample.loss_mask[p] and sample.loss_mask[p + 1]
            terms = _block_terms(model, sample, p)
            assert valid[row, a].tolist() == [k < len(terms) for k in range(gamma)], (row, p)
            for k, (w, ce, tv, bce, c) in enumerate(terms):
                assert c_star[row, a, k].item() == pytest.approx(c, abs=1e-5)
                sums = [s + w * t for s, t in zip(sums, (ce, tv, bce, 0.0), strict=True)]
                den += w
            blocks += 1
    # every candidate is an anchor: the blocks at 7 and 8 reach over the user turn
    assert anchor_valid.sum(1).tolist() == [13, 5, 1] and blocks == 19
    ce, tv, bce = (s / den for s in sums[:3])
    assert out.ce.item() == pytest.approx(ce, rel=1e-5)
    assert out.tv.item() == pytest.approx(tv, rel=1e-5)
    assert out.bce.item() == pytest.approx(bce, rel=1e-5)
    assert out.loss.item() == pytest.approx(CE_W * ce + TV_W * tv + BCE_W * bce, rel=1e-5)


def test_a_batch_with_nothing_to_supervise_gives_a_zero_loss_and_zero_gradients():
    """Samples without an anchor candidate (a single token, a prompt with a one-token answer,
    an answer masked out): one dummy block a row, a finite zero loss whose backward reaches
    the trainable weights with zeros, and no tau or per-slot acceptance to report."""
    model = tiny_draft()
    cfg = model.config
    gen = torch.Generator().manual_seed(5)
    samples = [_sample("one", [1], cfg, gen), _sample("tail", [0, 0, 0, 1], cfg, gen),
               _sample("none", [0] * 7, cfg, gen)]
    batch = collate(samples)
    anchors, anchor_valid = sample_anchors(batch.loss_mask, 512)
    assert anchors.shape == (3, 1) and not anchor_valid.any()
    out = model(batch.input_ids, batch.loss_mask, batch.aux, batch.final, anchors, anchor_valid)
    assert out.loss.item() == 0.0 and not out.valid.any()
    out.loss.backward()
    grads = [p.grad for p in model.trainable_parameters()]
    assert grads and all(g is not None and torch.isfinite(g).all() and not g.any() for g in grads)
    assert math.isnan(out.expected_acceptance_length().item())
    assert torch.isnan(out.slot_acceptance()).all()
