"""Training, export and evaluation conventions agree: a draft that memorised one response decodes it
with the maximum acceptance length through export -> load -> real speculative decoding.

The draft is fitted with the training objective (``DSparkDraft.forward``) directly, not the trainer,
so this checks the conventions this part owns (slot offset, context cut, layer ids, mask token,
Markov inputs) between the objective, the exporter, the loader and the evaluator.
"""

from __future__ import annotations

import torch
from eval_helpers import random_prompts, tiny_eval_draft, tiny_target

from draftforge.eval.baselines import NoDraft
from draftforge.eval.harness import EvalSettings, run_workload
from draftforge.eval.speculative import DecodeSettings, TargetSession, speculative_decode
from draftforge.train.blocks import sample_anchors
from draftforge.train.export import export_draft
from draftforge.train.hf_load import load_exported_draft


def test_memorised_response_reaches_full_acceptance_after_export(tmp_path):
    torch.manual_seed(0)
    target = tiny_target()
    draft = tiny_eval_draft(target)
    prompt = random_prompts(1, seed=5)[0]
    response = speculative_decode(
        TargetSession(target.model, None), prompt, NoDraft(), DecodeSettings(max_new_tokens=40)
    ).tokens
    ids = torch.tensor([prompt + response])
    feats = target.features(ids)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[0, len(prompt) :] = True
    optimizer = torch.optim.AdamW(draft.trainable_parameters(), lr=3e-3)
    draft.train()
    generator = torch.Generator().manual_seed(0)
    for _ in range(100):
        anchors, valid = sample_anchors(loss_mask, 64, generator=generator)
        out = draft(ids, loss_mask, feats.aux, feats.final, anchors, valid,
                    objective=dict(ce_weight=1.0, tv_weight=0.5))  # fmt: skip
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()

    export = export_draft(draft.eval(), tmp_path / "export", progress=lambda _: None)
    loaded = load_exported_draft(export, target=target)
    result = run_workload(
        "overfit", [prompt], loaded, target,
        EvalSettings(max_new_tokens=len(response), tie_tolerance=0.0), progress=lambda _: None,
    )  # fmt: skip
    dspark = result.methods["dspark"]
    gamma = loaded.config.block_size
    assert dspark["acceptance_length"] == gamma + 1  # every round accepts the whole block
    assert dspark["position_acceptance"] == [1.0] * gamma
    assert dspark["tokens"] == len(response)
    # The greedy teacher-forced estimate sees the same: only blocks cut by the response end are shorter.
    assert result.estimate["tau_greedy"] > gamma
