"""Precision of the parallel strategies under bf16, each in a one-rank gloo process: FSDP2 hands the
objective the trainer's fp32 loss denominator, DeepSpeed reduces and accumulates gradients in
fp32, and a DeepSpeed checkpoint holds the fp32 master weights."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from splitserve_helpers import PYTHON, ROOT, free_port

pytestmark = pytest.mark.distributed

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed==0.19.8)")

PRELUDE = """
import json, os, sys
from pathlib import Path
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1)
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config
from draftforge.train.sample import Sample, pack
from draftforge.train.trainer import Trainer
run = Path(sys.argv[1])
"""

FSDP2_DENOMINATOR = PRELUDE + """
from draftforge.train import model as M

received = []
objective = M.dspark_objective
def spy(*args, denominator=None, **kwargs):
    received.append(denominator)
    return objective(*args, denominator=denominator, **kwargs)
M.dspark_objective = spy

def one_step(name, batch):
    trainer = Trainer(model_config=tiny_model_config(), embeddings=target_embeddings(), run_dir=run / name,
                      train=train_config(output_dir=str(run / name), strategy="fsdp2", dtype="bfloat16",
                                         steps=1, num_anchors=40), group=dist.group.WORLD)
    expected = trainer._step_denominator([trainer._prepare(batch, 0)])  # step 0, micro-batch 0
    received.clear()
    records = []
    trainer.fit([batch], on_step=records.append)
    return expected, received[0], records[0]["loss"]

batch = pack(chain_samples(8), 80)[0]
expected, got, loss = one_step("bf16-features", batch)
as_fp32 = [Sample(s.sample_id, s.input_ids, s.loss_mask, s.aux.float(), s.final.float(), s.provenance)
           for s in batch]
_, _, loss_fp32_features = one_step("fp32-features", as_fp32)
print("RESULT " + json.dumps({
    "expected": expected.item(), "expected_dtype": str(expected.dtype),
    "received": got.float().item(), "received_dtype": str(got.dtype),
    "loss": loss, "loss_fp32_features": loss_fp32_features,
}))
dist.destroy_process_group()
"""

DEEPSPEED_BF16 = PRELUDE + """
import deepspeed
from deepspeed.utils import safe_get_full_fp32_param

stage = int(sys.argv[3])
trainer = Trainer(model_config=tiny_model_config(), embeddings=target_embeddings(), run_dir=run,
                  train=train_config(output_dir=str(run), strategy="deepspeed", zero_stage=stage,
                                     dtype="bfloat16", steps=2, lr=1e-2), group=dist.group.WORLD)
engine = trainer.engine
result = trainer.fit(pack(chain_samples(24), 80))
masters, live = {}, {}
for name, param in trainer.model.named_parameters():
    if param.requires_grad:
        masters[name] = safe_get_full_fp32_param(param).cpu()
params = list(trainer.model.parameters())
with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=stage == 3):
    live = {k: v.detach().cpu().clone() for k, v in trainer.model.state_dict().items()}
torch.save({"masters": masters, "live": live}, run / "expected.pt")
print("RESULT " + json.dumps({
    "communication_data_type": str(engine.communication_data_type),
    "data_types": [str(t) for t in engine.get_data_types()],
    "checkpoint": str(result.checkpoint), "steps_run": result.steps_run, "skipped": result.skipped_steps,
}))
dist.destroy_process_group()
from trainer_helpers import leave_at_once
leave_at_once()
"""


def _run_script(tmp_path, source: str, *args: str) -> dict:
    script = tmp_path / "script.py"
    script.write_text(source)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "tests"))
    done = subprocess.run([PYTHON, str(script), str(tmp_path / "run"), str(free_port()), *args], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


def test_fsdp2_bf16_objective_gets_the_fp32_denominator(tmp_path):
    """FSDP2's mixed precision used to cast every floating forward input to bf16, the step's
    weight sum too (133.209 arrived as 133.0 here); the draft casts its features itself, so
    fp32 features give the very same loss as bf16 ones."""
    out = _run_script(tmp_path, FSDP2_DENOMINATOR)
    assert out["expected_dtype"] == "torch.float32"
    assert out["received_dtype"] == "torch.float32", out
    assert out["received"] == out["expected"], out
    assert out["expected"] != float(torch.tensor(out["expected"]).bfloat16())  # bf16 would round it
    assert out["loss_fp32_features"] == out["loss"], out


@needs_deepspeed
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_bf16_reduces_in_fp32_and_checkpoints_the_fp32_masters(tmp_path, stage):
    """Gradients are reduced and accumulated in fp32 (DeepSpeed's bf16 defaults use bf16), and a
    checkpoint's model.safetensors holds the optimizer's fp32 master weights, whose bf16 rounding
    the module trains with, not bf16 copies; the frozen embedding and lm_head as the module holds them."""
    out = _run_script(tmp_path, DEEPSPEED_BF16, str(stage))
    assert out["communication_data_type"] == "torch.float32"
    assert out["data_types"] == ["torch.bfloat16", "torch.float32"]  # model, gradient accumulation
    assert out["steps_run"] == 2 and out["skipped"] == 0
    saved = load_file(os.path.join(out["checkpoint"], "model.safetensors"))
    expected = torch.load(tmp_path / "run" / "expected.pt", weights_only=True)
    masters, live = expected["masters"], expected["live"]
    assert sorted(saved) == sorted(live)
    assert masters and set(masters) < set(saved)
    not_bf16 = 0
    for name, master in masters.items():
        assert saved[name].dtype == torch.float32, name
        assert torch.equal(saved[name], master), name
        assert live[name].dtype == torch.bfloat16, name
        assert torch.equal(saved[name].bfloat16(), live[name]), name
        not_bf16 += int(not torch.equal(saved[name].bfloat16().float(), saved[name]))
    assert not_bf16 == len(masters)  # every trained weight holds bits a bf16 copy would lose
    for name in set(saved) - set(masters):  # frozen: embed_tokens, lm_head
        assert torch.equal(saved[name], live[name]), name
