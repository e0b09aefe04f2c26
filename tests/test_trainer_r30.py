"""Review round 30 of the training loop: D-PACE position weights across trainer ranks.

With ``train.loss.position_weighting: dpace`` the objective's denominator is not known before
the forward (it depends on c*), so each forward sums it over the trainer ranks itself
(``reduce_sum``) instead of taking the trainer's precomputed step denominator. No other test
runs that path on more than one rank. Here two FSDP2 trainer ranks beside an idle rank (a
stand-in for a target rank, so the trainer group is a subgroup of the world: the denominator
and FSDP2's gradient average must cover the two trainers, not the world of three), with the
clip active, must equal one process stepping on the union of their batches.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_helpers import (
    chain_samples,
    run_script_ranks,
    target_embeddings,
    tiny_model_config,
    train_config,
)

from draftforge.train.sample import pack
from draftforge.train.trainer import Trainer

WORKER = Path(__file__).with_name("trainer_worker.py")
NUM_SAMPLES, BUDGET = 24, 80
ALL_ANCHORS = 40  # every candidate of a <= 40-token sample: anchors do not depend on the rank layout
CLIP = 0.05  # far below the problem's gradient norm (~0.5 under dpace): every step is clipped


def _launch(tmp_path: Path, *, world: int, trainer_ranks: list[int], train: dict) -> dict:
    out = tmp_path / "multi.json"
    job = tmp_path / "job.json"
    job.write_text(json.dumps(dict(trainer_ranks=trainer_ranks, train=train, run_dir=str(tmp_path / "multi"),
                                   num_samples=NUM_SAMPLES, token_budget=BUDGET, out=str(out))))
    run_script_ranks(str(WORKER), job, world=world)
    result = json.loads(out.read_text())
    result["state"] = load_file(str(out) + ".safetensors")
    return result


@pytest.mark.distributed
def test_dpace_on_two_fsdp2_trainers_beside_an_idle_rank_equals_one_process(tmp_path):
    train = dict(strategy="fsdp2", dtype="float32", steps=3, num_anchors=ALL_ANCHORS, max_grad_norm=CLIP,
                 loss={"position_weighting": "dpace"})
    multi = _launch(tmp_path, world=3, trainer_ranks=[1, 2], train=train)

    # One process, each step on the union of what the two trainers took at that step.
    batches = pack(chain_samples(NUM_SAMPLES), BUDGET)
    merged = [batches[i] + batches[i + 1] for i in range(0, len(batches) - 1, 2)]
    records: list[dict] = []
    one = Trainer(model_config=tiny_model_config(), train=train_config(**dict(train, strategy="single")),
                  embeddings=target_embeddings(), run_dir=tmp_path / "single")
    one.fit(merged, on_step=records.append)

    assert len(multi["losses"]) == len(records) == 3
    assert all(r["grad_norm"] > 5 * CLIP for r in records)  # the clip acted
    assert [sorted(ids) for ids in multi["sample_ids"]] == [sorted(r["sample_ids"]) for r in records]
    torch.testing.assert_close(torch.tensor(multi["losses"]), torch.tensor([r["loss"] for r in records]),
                               rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(torch.tensor(multi["grad_norms"]),
                               torch.tensor([r["grad_norm"] for r in records]), rtol=2e-5, atol=2e-6)
    for name, value in one.full_state_dict().items():
        torch.testing.assert_close(multi["state"][name].float(), value.float(), rtol=2e-5, atol=2e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
