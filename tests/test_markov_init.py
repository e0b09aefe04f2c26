"""``train.markov_init: bigram``: the table against a hand count, the head against the table,
and the checks that refuse it where it cannot work."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from dspark_helpers import tiny_draft

from draftforge.config import RecipeError, load_recipe
from draftforge.errors import InputError
from draftforge.train.markov_init import bigram_scores, init_markov_bigram

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-debug.yaml"
SEQUENCES = [[1, 2, 3, 1, 2, 4], [1, 2, 3]]


def test_scores_equal_a_hand_count():
    # pairs: (1,2) x3, (2,3) x2, (3,1) x1, (2,4) x1; previous tokens seen twice or more: 1, 2
    rows, cols, scores = bigram_scores(SEQUENCES)
    assert rows.tolist() == [1, 2] and cols.tolist() == [1, 2, 3, 4]
    unigram = {1: 1 / 7, 2: 3 / 7, 3: 2 / 7, 4: 1 / 7}  # next-token counts 1, 3, 2, 1 of 7
    counts = {1: {2: 3}, 2: {3: 2, 4: 1}}
    for i, prev in enumerate([1, 2]):
        total = sum(counts[prev].values())
        raw = [math.log((counts[prev].get(b, 0) + unigram[b]) / (total + 1)) for b in [1, 2, 3, 4]]
        mean = sum(raw) / len(raw)
        assert scores[i].tolist() == pytest.approx([r - mean for r in raw], abs=1e-12)


def test_head_holds_the_table_when_the_rank_allows_it():
    model = tiny_draft(markov_rank=8)
    message = init_markov_bigram(model, SEQUENCES)
    rows, cols, scores = bigram_scores(SEQUENCES)
    head = model.markov_head
    with torch.no_grad():  # [prev, next] over the whole vocabulary
        logits = head.markov_w1.weight @ head.markov_w2.weight.T
    assert torch.allclose(logits[rows][:, cols].double(), scores, atol=1e-5)
    others = torch.ones(logits.shape[0], dtype=torch.bool)
    others[rows] = False
    assert torch.count_nonzero(logits[others]) == 0  # unseen previous tokens: no correction
    assert "rank-2 bigram" in message and "2 previous x 4 next tokens" in message
    # the greedy next token after 2 is 3 (seen twice), as the counts say
    assert int(logits[2].argmax()) == 3
    # the same samples give the same weights (every FSDP2 rank initialises alone, from the
    # same seeded init): whatever the global random state, and the table's columns whatever
    # the init
    again, other_init = tiny_draft(seed=0, markov_rank=8), tiny_draft(seed=1, markov_rank=8)
    torch.manual_seed(123)
    init_markov_bigram(again, SEQUENCES)
    init_markov_bigram(other_init, SEQUENCES)
    assert torch.equal(again.markov_head.markov_w1.weight, head.markov_w1.weight)
    assert torch.equal(again.markov_head.markov_w2.weight, head.markov_w2.weight)
    assert torch.equal(other_init.markov_head.markov_w1.weight[:, :2], head.markov_w1.weight[:, :2])
    assert torch.equal(other_init.markov_head.markov_w2.weight, head.markov_w2.weight)


def test_spare_rank_keeps_the_table_exact_and_still_learns():
    """A rank-8 head over a rank-2 table: zero spare columns in both W1 and W2 would never get
    a gradient (the confidence head does not read W1 here). W2's are zero, W1's random: the
    product is the table's rank-2 SVD, and one AdamW step moves W2's spare columns."""
    from dspark_helpers import random_batch

    from draftforge.train.blocks import sample_anchors

    model = tiny_draft(markov_rank=8, confidence_head_with_markov=False)
    head = model.markov_head
    init_markov_bigram(model, SEQUENCES)
    rows, cols, scores = bigram_scores(SEQUENCES)
    u, s, vh = torch.linalg.svd(scores)
    best = (u[:, :2] * s[:2]) @ vh[:2]  # the rank-2 approximation, independently
    assert torch.linalg.matrix_rank(scores) == 2
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    with torch.no_grad():
        table = torch.zeros(w1.shape[0], w2.shape[0], dtype=torch.float64)
        table[rows[:, None], cols] = best
        torch.testing.assert_close((w1 @ w2.T).double(), table, atol=1e-5, rtol=0)
    assert torch.count_nonzero(w2[:, 2:]) == 0 and torch.count_nonzero(w1[:, 2:]) == w1[:, 2:].numel()
    spare_w1 = w1[:, 2:].detach().clone()
    input_ids, loss_mask, aux, final = random_batch(model.config)
    anchors, valid = sample_anchors(loss_mask, 6, generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(2):
        optimizer.zero_grad()
        model(input_ids, loss_mask, aux, final, anchors, valid).loss.backward()
        optimizer.step()
        assert torch.count_nonzero(w2[:, 2:]) > 0  # from the first step on
    assert not torch.equal(w1[:, 2:], spare_w1)  # and W1's, once W2's are no longer zero


def test_gated_head_starts_as_the_table_whatever_the_hidden_state():
    """sigmoid(gate_proj([h; W1[prev]])) scales the latent: at about 1/2 from a random gate the
    head would start at half the table. The bigram init makes the correction the table itself."""
    model = tiny_draft(markov_rank=8, markov_head_type="gated")
    init_markov_bigram(model, SEQUENCES)
    rows, cols, scores = bigram_scores(SEQUENCES)
    head = model.markov_head
    hidden = torch.randn(len(rows), model.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 3
    latent, _, _ = head.step(rows, hidden, None)
    correction = head.markov_w2(latent)
    torch.testing.assert_close(correction[:, cols].double(), scores, atol=1e-5, rtol=0)
    others = torch.ones(correction.shape[1], dtype=torch.bool)
    others[cols] = False
    assert torch.count_nonzero(correction[:, others]) == 0
    correction.square().sum().backward()  # the gate still learns (not saturated)
    assert head.gate_proj.weight.grad.abs().sum() > 0 and head.gate_proj.bias.grad.abs().sum() > 0


def test_too_little_data_for_a_table_is_refused_clearly():
    # every previous token occurs once: no row of the table is kept
    with pytest.raises(ValueError, match=r"too little data for a bigram table.*train\.markov_init=random"):
        init_markov_bigram(tiny_draft(markov_rank=8), [[1, 2, 3]])
    rows, cols, _ = bigram_scores([[1, 2, 1, 3]])  # one row: long ids, usable as an index
    assert rows.dtype == cols.dtype == torch.long and rows.tolist() == [1]


def test_low_rank_keeps_the_largest_structure():
    # 6 previous tokens, each always followed by its own next token: rank 2 cannot hold all
    sequences = [[p, p + 10] * 3 for p in range(20, 26)] + [[20, 31, 20, 32, 21, 33, 22, 31]]
    model = tiny_draft(markov_rank=2)
    init_markov_bigram(model, sequences)
    head = model.markov_head
    assert head.markov_w1.weight.abs().sum() > 0
    rows, cols, scores = bigram_scores(sequences)
    with torch.no_grad():
        approx = (head.markov_w1.weight[rows] @ head.markov_w2.weight[cols].T).double()
    best = torch.linalg.svdvals(scores)
    # the error of a rank-2 truncation is the energy beyond the first two singular values
    error = float(((approx - scores) ** 2).sum())
    assert error == pytest.approx(float((best[2:] ** 2).sum()), rel=1e-3)


def test_a_head_without_a_table_is_refused():
    with pytest.raises(ValueError, match="vanilla or gated Markov head"):
        init_markov_bigram(tiny_draft(markov_rank=8, markov_head_type="rnn"), SEQUENCES)
    for override in ("draft.markov_rank=0", "draft.markov_head_type=rnn"):
        with pytest.raises(RecipeError, match="train.markov_init: bigram fills"):
            load_recipe(TINY, ["train.markov_init=bigram", override,
                               "draft.confidence_head_with_markov=false"])  # fmt: skip


def test_bigram_needs_the_answers_before_training(tmp_path):
    from draftforge.splitserve.launch import preflight
    from draftforge.splitserve.producer import markov_init_samples

    # tiny-debug regenerates on the fly: no answers exist before the first step
    cfg = load_recipe(TINY, [f"train.output_dir={tmp_path}", "train.markov_init=bigram"])
    with pytest.raises(InputError, match="draftforge data regenerate RECIPE' first"):
        preflight(cfg)
    with pytest.raises(InputError, match="draftforge data regenerate RECIPE' first"):
        markov_init_samples(cfg)
    # conversations given as they are: their tokens, as the producer tokenises them
    from splitserve_helpers import tiny_recipe

    from draftforge.data.tokenize import tokenize_conversations
    from draftforge.splitserve.producer import load_source_conversations
    from draftforge.splitserve.target import load_tokenizer

    cfg = load_recipe(tiny_recipe(tmp_path, overrides={"train.markov_init": "bigram"}))
    preflight(cfg)
    conversations, _ = load_source_conversations(cfg)
    samples, _ = tokenize_conversations(
        conversations, load_tokenizer(cfg.target), max_length=cfg.data.max_length,
        min_loss_tokens=cfg.data.min_loss_tokens,
    )  # fmt: skip
    assert markov_init_samples(cfg) == ([s.input_ids for s in samples], [s.loss_mask for s in samples])


def test_with_loss_masks_only_the_supervised_pairs_count():
    """The head corrects answer tokens from the token before them (both supervised, as every
    slot's previous token and label are); a prompt's pairs counted 50 times (7 then 8) would
    make 8 the favourite after 7, where every answer has 9 after 7."""
    prompt, answer = [7, 8] * 50, [7, 9, 7, 9, 7, 9]
    ids = [prompt + answer]
    mask = [[0] * len(prompt) + [1] * len(answer)]
    rows, cols, scores = bigram_scores(ids, masks=mask)
    row, col = {int(t): i for i, t in enumerate(rows)}, {int(t): j for j, t in enumerate(cols)}
    assert 8 not in col  # never a supervised next token
    assert 7 in row and 9 in col
    unmasked_rows, unmasked_cols, unmasked = bigram_scores(ids)  # every pair: the prompt's win
    r = {int(t): i for i, t in enumerate(unmasked_rows)}[7]
    c = {int(t): j for j, t in enumerate(unmasked_cols)}
    assert unmasked[r, c[8]] > unmasked[r, c[9]]
    # by hand: the answer's pairs 7-9, 9-7, 7-9, 9-7, 7-9 (the seam 8-7 has 8 unsupervised):
    # c(7,9) = 3, c(9,7) = 2; next-token unigram P(7) = 2/5, P(9) = 3/5; rows centred
    assert rows.tolist() == [7, 9] and cols.tolist() == [7, 9]
    raw = torch.tensor([[math.log((0 + 0.4) / 4), math.log((3 + 0.6) / 4)],
                        [math.log((2 + 0.4) / 3), math.log((0 + 0.6) / 3)]], dtype=torch.float64)
    torch.testing.assert_close(scores, raw - raw.mean(dim=1, keepdim=True))
    with pytest.raises(ValueError, match="1 loss masks for 2 sequences"):
        bigram_scores([[1, 2], [3, 4]], masks=[[1, 1]])
