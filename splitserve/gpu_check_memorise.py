"""Check 4's draft: one that memorised the greedy answers to the check's own prompts.

Check 4 (:mod:`draftforge.splitserve.gpu_check_serving`) compares SGLang's tokens per
verification step with draftforge's evaluator. A draft that accepts almost nothing gives
~1 token per step on both sides whatever SGLang does with it, and ``compare_acceptance``
refuses that as uninformative; check 2's one-step run is such a draft. So check 4 fits a
fresh draft of the check's shape to the fixed-length greedy answers of its prompts with
the training objective, as ``tests/test_eval_overfit.py`` does, and serves that one.

Time on one H200 (estimated, not yet measured there): the float32 target loads in ~3 s,
the three 32-token greedy answers take ~1 s, and each of the ``MEMORISE_STEPS`` steps runs
3 x 31 blocks of 8 slots over SmolLM2's 49,152-token vocabulary (~0.1 TFLOP with the
backward, and a few hundred small kernels), ~10-30 ms: 10-20 s in all, of check 4's
240 s cap and the 450 s of ``make gpu-check``. Measured on two CPU cores (2.5-7 s a
step): loss 87 at step 1, 4.1 at 80, 1.9 at 150, where draftforge's evaluator already
made 4.0 tokens per verification step on check 4's prompts (96 tokens in 24 rounds; at
most 9 with block 8); ``MEMORISE_STEPS`` leaves a margin over that.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MEMORISE_STEPS = 500
MEMORISE_LR = 3e-3
MEMORISE_SEED = 0
LOG_EVERY = 50
# tests/test_eval_overfit.py's weights; not compiled: a few hundred small steps do not
# pay for torch.compile's start-up.
MEMORISE_OBJECTIVE = {"ce_weight": 1.0, "tv_weight": 0.5, "compile": False}


@dataclass(frozen=True)
class Memorised:
    """Where the memorised draft was exported, and how its fit ended."""

    folder: Path
    steps: int
    loss: float
    wall_s: float


def greedy_answers(target, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy answer of exactly ``max_new_tokens`` tokens, EOS ignored: what
    check 4 decodes on both sides (draftforge's evaluator with no EOS ids, SGLang with
    ``ignore_eos``), by the evaluator's own plain decoding."""
    from draftforge.eval.baselines import NoDraft
    from draftforge.eval.speculative import DecodeSettings, TargetSession, speculative_decode

    session = TargetSession(target.model, None)
    settings = DecodeSettings(max_new_tokens=max_new_tokens, temperature=0.0, eos_token_ids=())
    return [speculative_decode(session, list(p), NoDraft(), settings).tokens for p in prompts]


def memorise_batch(target, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]):
    """(input_ids, loss_mask, aux, final): prompt + answer rows, right-padded, the loss on the
    answers. Each row's features are taken alone and unpadded, as the evaluator's target
    session sees them; the padding is zero and outside the loss mask."""
    import torch

    rows = [list(p) + list(a) for p, a in zip(prompts, answers, strict=True)]
    width = max(len(row) for row in rows)
    feats = [target.features(torch.tensor([row])) for row in rows]
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), width, dtype=torch.bool)
    aux = feats[0].aux.new_zeros(len(rows), width, feats[0].aux.shape[-1])
    final = feats[0].final.new_zeros(len(rows), width, feats[0].final.shape[-1])
    for i, (row, prompt, feat) in enumerate(zip(rows, prompts, feats, strict=True)):
        input_ids[i, :len(row)] = torch.tensor(row)
        loss_mask[i, len(prompt):len(row)] = True
        aux[i, :len(row)] = feat.aux[0]
        final[i, :len(row)] = feat.final[0]
    device = aux.device
    return input_ids.to(device), loss_mask.to(device), aux.float(), final.float()


def memorise_draft(
    target, draft_section: dict[str, Any], shape, prompts: Sequence[Sequence[int]], *,
    max_new_tokens: int, out_dir: Path, steps: int = MEMORISE_STEPS, lr: float = MEMORISE_LR,
    seed: int = MEMORISE_SEED, progress: Callable[[str], None] = print,
) -> Memorised:
    """Fit a fresh draft of ``draft_section`` (a recipe's draft section) to the greedy answers
    of ``prompts`` on ``target`` (a transformers engine whose ``layer_ids`` are the section's
    ``target_layer_ids``; ``shape``: its :class:`~draftforge.splitserve.config.TargetShape`)
    and export it to ``out_dir``. Every answer position is an anchor at every step."""
    import torch

    from draftforge.train.blocks import sample_anchors
    from draftforge.train.config import DraftConfig, build_dspark_config
    from draftforge.train.export import export_draft
    from draftforge.train.model import DSparkDraft

    start = time.monotonic()
    section = DraftConfig(**draft_section)
    if list(section.target_layer_ids) != list(target.layer_ids):
        raise ValueError(f"the draft reads target layers {section.target_layer_ids} but the target "
                         f"captures {target.layer_ids}")
    embed, head = target.embed_tokens_weight(), target.lm_head_weight()
    draft = DSparkDraft(build_dspark_config(section, shape, vocab_size=int(embed.shape[0])))
    draft.init_weights(seed=seed)
    draft.load_target_embeddings(embed, head)
    draft.to(target.device, torch.float32).train()

    answers = greedy_answers(target, prompts, max_new_tokens)
    input_ids, loss_mask, aux, final = memorise_batch(target, prompts, answers)
    progress(f"[memorise] {len(prompts)} prompts x {max_new_tokens} greedy tokens; {steps} steps "
             f"of AdamW lr {lr:g} on {target.device}")
    optimizer = torch.optim.AdamW(draft.trainable_parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    loss = float("nan")
    for step in range(1, steps + 1):
        anchors, valid = sample_anchors(loss_mask, input_ids.shape[1], generator=generator)
        out = draft(input_ids, loss_mask, aux, final, anchors, valid, objective=MEMORISE_OBJECTIVE)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
        if step == 1 or step % LOG_EVERY == 0 or step == steps:
            loss = out.loss.item()
            progress(f"[memorise] step {step}/{steps} loss {loss:.4f} "
                     f"({time.monotonic() - start:.1f} s)")
    folder = export_draft(draft.eval(), out_dir, progress=progress)
    return Memorised(folder, steps, loss, time.monotonic() - start)
