"""A real learning test: a few hundred AdamW steps on a tiny fixed problem."""

from __future__ import annotations

import torch
from dspark_helpers import tiny_draft

from draftforge.train.blocks import sample_anchors


def _problem(model, batch=4, seq_len=40, seed=0):
    """Sequences that follow a fixed random permutation, a target that knows it."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    successor = torch.randperm(cfg.vocab_size, generator=gen)
    starts = torch.randint(0, cfg.vocab_size, (batch,), generator=gen)
    tokens = [starts]
    for _ in range(seq_len - 1):
        tokens.append(successor[tokens[-1]])
    input_ids = torch.stack(tokens, dim=1)
    loss_mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    loss_mask[:, 4:] = True
    # Auxiliary features: a fixed random code of each token (what a target layer would carry).
    code = torch.randn(cfg.vocab_size, cfg.num_context_features, generator=gen)
    aux = code[input_ids]
    # The target's final state at j points at its next-token prediction successor[x_j].
    final = 4.0 * model.lm_head.weight[successor[input_ids]] / model.lm_head.weight.norm(dim=-1).mean()
    return input_ids, loss_mask, aux, final.detach()


def test_training_lowers_loss_and_raises_tau():
    torch.manual_seed(0)
    model = tiny_draft(num_hidden_layers=1)
    input_ids, loss_mask, aux, final = _problem(model)
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    history = []
    for _ in range(300):
        anchors, valid = sample_anchors(loss_mask, 8, generator=gen)
        out = model(input_ids, loss_mask, aux, final, anchors, valid, objective={"chunk_blocks": 8})
        optimizer.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.trainable_parameters(), 1.0)
        optimizer.step()
        history.append((out.loss.item(), out.expected_acceptance_length().item()))
    first = sum(h[0] for h in history[:10]) / 10
    last = sum(h[0] for h in history[-10:]) / 10
    tau_first = sum(h[1] for h in history[:10]) / 10
    tau_last = sum(h[1] for h in history[-10:]) / 10
    assert last < 0.4 * first, (first, last)
    # Block size 4: tau lies in [1, 5]; a draft that learnt the chain approaches the top.
    assert tau_first < 2.5 and tau_last > 4.0, (tau_first, tau_last)
