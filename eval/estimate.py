"""The train-time estimate of acceptance, computed on the evaluator's own data (metric honesty).

Training logs ``tau = 1 + sum_k prod_{i<=k} c*_i`` with ``c*_k = 1 - 0.5 ||p_d,k - p_t,k||_1``,
teacher-forced on target-generated text. Here it is computed through the
training objective itself (``DSparkDraft.forward``) on the target's outputs for
the evaluation prompts, so users see how far the training metric is from the
acceptance length measured by real decoding. A second estimate, ``tau_greedy``,
replaces ``c*_k`` by the greedy indicator ``argmax p_d,k == x_{p+k+1}`` (still
teacher-forced): on the target's greedy outputs it is what greedy decoding
would measure if every response position were an anchor.

Known gaps (documented in the report):

* ``c*`` is the acceptance probability of speculative *sampling* at temperature
  1; greedy verification accepts iff the argmax matches, which can be higher or
  lower than ``c*`` per slot.
* The estimate averages over every response position as an anchor; decoding
  only anchors where the previous round ended (after rejections), which are the
  harder positions, so measured AL is usually below the estimate.
* Blocks near the end of a response are cut (fewer valid slots) in the estimate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftforge.train.blocks import sample_anchors


@torch.no_grad()
def train_time_estimate(
    draft,
    target,
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    max_anchors: int = 64,
    seed: int = 0,
) -> dict:
    """``tau`` (objective c*) and ``tau_greedy`` over up to ``max_anchors`` response anchors per sequence.

    ``sequences``: (prompt ids, target output ids). ``target`` provides
    ``features(input_ids)`` (an HFTarget).
    """
    draft = draft.eval()
    gamma = draft.config.block_size
    device = draft.fc.weight.device
    generator = torch.Generator().manual_seed(seed)
    c_stars, valids, greedy_taus = [], [], []
    for prompt, output in sequences:
        ids = list(prompt) + list(output)
        prompt_len = len(prompt)
        if len(output) < 2:
            continue
        input_ids = torch.tensor([ids], dtype=torch.long)
        feats = target.features(input_ids)
        aux, final = feats.aux.to(device), feats.final.to(device)
        loss_mask = torch.zeros_like(input_ids, dtype=torch.bool)
        loss_mask[0, prompt_len:] = True
        anchors, valid = sample_anchors(loss_mask, max_anchors, generator=generator)
        out = draft(input_ids.to(device), loss_mask.to(device), aux, final, anchors.to(device), valid.to(device))
        blocks = out.valid[:, 0]
        c_stars.append(out.c_star[blocks].float().cpu())
        valids.append(out.valid[blocks].float().cpu())
        for p in anchors[0][valid[0]].tolist():
            truth = ids[p + 1 : p + 1 + gamma]
            anchor = torch.tensor([ids[p]], device=device)
            hidden = draft.block_forward(anchor, p, aux[:, :p])
            forced = torch.tensor(truth + [0] * (gamma - len(truth)), device=device)
            _, logits, _ = draft.draft_block(hidden, anchor, sample=lambda _l, k, forced=forced: forced[k : k + 1])
            match = (logits[0, : len(truth)].argmax(-1).cpu() == torch.tensor(truth)).long()
            greedy_taus.append(1 + int(match.cumprod(0).sum()))
    if not c_stars:
        return {"tau": float("nan"), "tau_greedy": float("nan"), "slot_c_star": [], "num_blocks": 0}
    c_star, slot_valid = torch.cat(c_stars), torch.cat(valids)
    tau = float((1.0 + (c_star * slot_valid).cumprod(-1).sum(-1)).mean())
    slot_means = (c_star * slot_valid).sum(0) / slot_valid.sum(0).clamp_min(1)
    return {
        "tau": tau,
        "tau_greedy": sum(greedy_taus) / len(greedy_taus),
        "slot_c_star": [float(x) for x in slot_means],
        "num_blocks": int(c_star.shape[0]),
    }
