"""Session 50: a DeepSpeed ZeRO-2 resume clips by this recipe's train.max_grad_norm."""

from __future__ import annotations

import pytest
import torch

CLIP_ON_RESUME = """
import os, sys
from pathlib import Path
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1)
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config
from draftforge.train.sample import pack
from draftforge.train.trainer import Trainer
run = Path(sys.argv[1])
def trainer(steps, resume, clip):
    return Trainer(model_config=tiny_model_config(num_hidden_layers=1), embeddings=target_embeddings(),
                   train=train_config(output_dir=str(run), strategy="deepspeed", zero_stage=2,
                                      dtype="float32", steps=steps, resume=resume, max_grad_norm=clip),
                   run_dir=run, recipe_yaml="name: t\\n", group=dist.group.WORLD)
trainer(1, "never", 1.0).fit(pack(chain_samples(20), 90))
resumed = trainer(2, "auto", 0.25)
resumed.resume()
print("CLIP", resumed.optimizer.clip_grad)
dist.destroy_process_group()
from trainer_helpers import leave_at_once
leave_at_once()
"""


def test_a_zero2_resume_clips_by_this_recipes_max_grad_norm(tmp_path):
    """DeepSpeed's ZeRO-2 optimizer saves its clip value and puts it back on load, so a run
    resumed with a lower train.max_grad_norm (after loss spikes, say) went on clipping at the
    old one while the resume note said the steps follow this recipe."""
    pytest.importorskip("deepspeed")
    from splitserve_helpers import run_script_rank

    out = run_script_rank(CLIP_ON_RESUME, tmp_path, "clip.py")
    assert "CLIP 0.25" in out, out[-3000:]
    assert ("gradient clipping 1.0 -> 0.25: this recipe's train.max_grad_norm replaces the "
            "checkpointed run's from step 2") in out


def test_deepspeed_gathers_the_full_state_one_master_at_a_time(tmp_path):
    """Every gathered fp32 master (a full tensor on the trainer's device) was held until the
    end on every rank, also where the result is dropped: 4 bytes a trainable parameter of
    device memory at each checkpoint, which fsdp2's gather no longer costs."""
    import json

    import torch.multiprocessing as mp
    pytest.importorskip("deepspeed")
    from trainer_helpers import deepspeed_full_state_worker

    out = str(tmp_path / "result")
    mp.spawn(deepspeed_full_state_worker, args=(2, f"file://{tmp_path / 'store'}", out), nprocs=2, join=True)
    main, other = (json.loads(open(f"{out}.{rank}").read()) for rank in (0, 1))
    assert other["kept"] == [] and other["all"] == main["all"] == main["kept"]
    assert main["same"] and main["trainable"] > 5
    assert other["most_alive"] == 1  # dropped as soon as gathered


BF16_MASTERS = """
import os, sys
from pathlib import Path
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1)
from trainer_helpers import target_embeddings, tiny_model_config, train_config
from draftforge.train.trainer import Trainer
run = Path(sys.argv[1])
def state(**settings):
    trainer = Trainer(model_config=tiny_model_config(num_hidden_layers=1), embeddings=target_embeddings(),
                      train=train_config(output_dir=str(run / settings["strategy"]), dtype="bfloat16", **settings),
                      run_dir=run / settings["strategy"], recipe_yaml="name: t\\n", group=dist.group.WORLD)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    return {k: v for k, v in trainer.full_state_dict().items() if k in trainable}
reference = state(strategy="single")
for stage in (2, 3):
    masters = state(strategy="deepspeed", zero_stage=stage)
    assert sorted(masters) == sorted(reference), (sorted(masters), sorted(reference))
    exact = sum(torch.equal(masters[k], reference[k]) for k in reference)
    rounded = sum(torch.equal(reference[k].bfloat16().float(), reference[k]) for k in reference)
    print(f"STAGE {stage} exact {exact} of {len(reference)}, already bf16 {rounded}")
dist.destroy_process_group()
from trainer_helpers import leave_at_once
leave_at_once()
"""


def test_deepspeed_bf16_masters_start_from_the_fp32_initial_weights(tmp_path):
    """Under bf16 DeepSpeed casts the module to bf16 and builds its fp32 masters from those
    copies, so the masters (and every update after) started from the initial weights rounded
    to bf16, where single and fsdp2 start from the fp32 ones (the bigram start included)."""
    pytest.importorskip("deepspeed")
    from splitserve_helpers import run_script_rank

    out = run_script_rank(BF16_MASTERS, tmp_path, "masters.py")
    lines = [line for line in out.splitlines() if line.startswith("STAGE")]
    assert len(lines) == 2, out[-3000:]
    for line in lines:
        _, stage, _, exact, _, total, *_, rounded = line.split()
        assert exact == total.rstrip(","), line
        assert int(rounded) < int(exact)  # some weights are not bf16 values, so rounding would show


@pytest.mark.parametrize("error", [
    "torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')",
    "RuntimeError('[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory: you "
    "tried to allocate 8 bytes')",
])
def test_running_out_of_memory_while_loading_does_not_call_the_checkpoint_corrupt(tmp_path, error):
    """Every failure inside DeepSpeed's load was called corrupt, with the advice to delete the
    folder: for an out-of-memory error that advice loses a whole checkpoint that is intact."""
    from test_ckpt_r15 import _deepspeed_folder

    from draftforge.train import checkpoint as ckpt

    raised = eval(error, {"torch": torch})

    class Engine:
        def load_checkpoint(self, *args, **kwargs):
            raise raised

    path = _deepspeed_folder(tmp_path, ranks=1, stage=2)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load_checkpoint(path=path, strategy="deepspeed", model=None, optimizer=None,
                             engine=Engine(), group=None)
    message = str(info.value)
    assert message.startswith(f"loading checkpoint {path / 'deepspeed'} ran out of memory ("
                              f"{type(raised).__name__}: ")
    assert f"that says nothing against {path}: keep it" in message and "delete" not in message
    # any other failure is still named corrupt, with the advice that goes with it
    raised = ValueError("bad pickle")
    with pytest.raises(ckpt.CheckpointError, match="is corrupt or truncated \\(ValueError: bad pickle\\)"):
        ckpt.load_checkpoint(path=path, strategy="deepspeed", model=None, optimizer=None,
                             engine=Engine(), group=None)
