"""Checkpoint review, round 15: a recipe edited between a stop and a resume, and partial
checkpoint folders that used to pass every check before the strategy's own load failed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_checkpoint_r11 import _trainer, run, saved_run  # noqa: F401  (fixtures)
from trainer_helpers import chain_samples

from draftforge.train import checkpoint as ckpt
from draftforge.train.sample import pack


def _newest(run_dir: Path) -> Path:
    return ckpt.checkpoint_path(run_dir, 4)


# -- 1, 6. another train.zero_stage or train.dtype (deepspeed) is refused, not called corrupt

DEEPSPEED_OTHER_SETTINGS = """
import os, sys
from pathlib import Path
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1)
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config
from draftforge.train.sample import pack
from draftforge.train.trainer import Trainer
run = Path(sys.argv[1])
def trainer(steps, resume, **changed):
    settings = dict(output_dir=str(run), strategy="deepspeed", zero_stage=2, dtype="float32",
                    steps=steps, resume=resume)
    return Trainer(model_config=tiny_model_config(num_hidden_layers=1), embeddings=target_embeddings(),
                   train=train_config(**{**settings, **changed}),
                   run_dir=run, recipe_yaml="name: t\\n", group=dist.group.WORLD)
trainer(1, "never").fit(pack(chain_samples(20), 90))
for name, changed in [("zero_stage", dict(zero_stage=3)), ("dtype", dict(dtype="bfloat16"))]:
    try:
        trainer(2, "auto", **changed).resume()
        print("RESUMED", name)
    except Exception as exc:
        print("ERROR", name, type(exc).__name__, exc)
dist.destroy_process_group()
from trainer_helpers import leave_at_once
leave_at_once()
"""


@pytest.fixture(scope="module")
def deepspeed_resumes(tmp_path_factory) -> tuple[Path, str]:
    """A ZeRO-2 float32 checkpoint resumed with train.zero_stage=3, then with train.dtype=bfloat16."""
    pytest.importorskip("deepspeed")
    from splitserve_helpers import run_script_rank

    tmp_path = tmp_path_factory.mktemp("ds")
    stdout = run_script_rank(DEEPSPEED_OTHER_SETTINGS, tmp_path, "ds_settings.py")
    return ckpt.checkpoint_path(tmp_path / "run", 1), stdout


def test_a_deepspeed_resume_under_another_zero_stage_is_refused_naming_both_stages(deepspeed_resumes):
    """DeepSpeed cannot load ZeRO-2 files into a ZeRO-3 engine; it failed with a bare
    AssertionError, reported as "corrupt or truncated ... delete the folder": advice that
    would throw away a good checkpoint."""
    path, out = deepspeed_resumes
    assert (
        f"ERROR zero_stage CheckpointError checkpoint {path} was written with train.zero_stage=2, this "
        "run uses 3: DeepSpeed cannot load one stage's files into the other. Resume with "
        "train.zero_stage=2, or start a fresh run in another train.output_dir"
    ) in out, out[-2000:]


def test_a_deepspeed_resume_under_another_dtype_is_refused_naming_both(deepspeed_resumes):
    """DeepSpeed names its optimizer-state files by precision (bf16_zero_pp_rank_...); a resume
    in the other precision (train.dtype auto resolving otherwise on another machine, say)
    failed with a FileNotFoundError, reported as a corrupt checkpoint to delete."""
    path, out = deepspeed_resumes
    assert (
        f"ERROR dtype CheckpointError checkpoint {path} was written with train.dtype=float32, this run "
        "uses bfloat16: DeepSpeed keeps its optimizer state under file names of its precision and "
        "loads only its own. Resume with train.dtype=float32 (auto is bfloat16 only on CUDA or a CPU "
        "with native bf16 matmuls), or start a fresh run in another train.output_dir"
    ) in out, out[-2000:]


def test_another_strategy_is_refused_saying_how_to_resume(run):
    path = _newest(run)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.read_checked_state(path, strategy="fsdp2", trainer_ranks=1)
    assert str(info.value) == (
        f"checkpoint {path} was written with train.strategy='single', this run uses 'fsdp2'. "
        "Resume with train.strategy=single, or start a fresh run in another train.output_dir")


# -- 2. a file the strategy's load reads is named before anything loads ------------------


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "optimizer.json"])
def test_a_single_checkpoint_missing_a_file_resume_reads_is_refused_by_the_file_check(run, name):
    """The file check (which the launcher runs before torchrun starts, and trainer rank 0
    before any collective) passed such a folder; only the load itself failed, after the
    target had loaded."""
    path = _newest(run)
    (path / name).unlink()
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.read_checked_state(path, strategy="single", trainer_ranks=1)
    assert str(info.value) == (f"checkpoint {path} has no {name}; it is incomplete: delete it to "
                               "resume from the previous complete checkpoint")


def _deepspeed_folder(root: Path, *, ranks: int, stage: int, prefix: str = "") -> Path:
    """A checkpoint folder laid out as DeepSpeed writes it for ``ranks`` trainer ranks (the
    ``.pt`` files are torch.save zips, as DeepSpeed's are; ``prefix`` bf16_ under bf16)."""
    path = ckpt.checkpoint_path(root, 6)
    state = path / "deepspeed" / "state"
    state.mkdir(parents=True)
    (path / "rng").mkdir()
    for rank in range(ranks):
        save_file({"cpu": torch.get_rng_state()}, str(path / "rng" / f"rank_{rank}.safetensors"))
        torch.save({"rank": rank}, state / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        if stage == 3:
            torch.save({"rank": rank}, state / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    if stage == 2:
        torch.save({"module": {}}, state / "mp_rank_00_model_states.pt")
    (path / ckpt.STATE_FILE).write_text(json.dumps({
        "step": 6, "skipped_steps": 0, "strategy": "deepspeed",
        "consumed_ids": [[f"r{rank}"] for rank in range(ranks)]}))
    (path / ckpt.COMPLETE).write_text("step 6\n")
    return path


@pytest.mark.parametrize("stage", [2, 3])
def test_a_deepspeed_checkpoint_missing_one_ranks_file_names_it(tmp_path, stage):
    """Each trainer rank loads its own ZeRO files: a partial copy failed on that rank alone,
    inside DeepSpeed, while the other ranks went on to their next collective."""
    path = _deepspeed_folder(tmp_path, ranks=2, stage=stage)
    assert ckpt.read_checked_state(path, strategy="deepspeed", trainer_ranks=2, zero_stage=stage)["step"] == 6
    gone = path / "deepspeed" / "state" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    gone.unlink()
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.read_checked_state(path, strategy="deepspeed", trainer_ranks=2, zero_stage=stage)
    assert str(info.value) == (
        f"checkpoint {path} has no deepspeed/state/zero_pp_rank_1_mp_rank_00_optim_states.pt; it is "
        "incomplete: delete it and rerun: the run starts over, as no earlier complete checkpoint exists")


@pytest.mark.parametrize("stage", [2, 3])
def test_a_bf16_deepspeed_checkpoint_resumed_in_float32_is_refused(tmp_path, stage):
    path = _deepspeed_folder(tmp_path, ranks=2, stage=stage, prefix="bf16_")
    checked = dict(strategy="deepspeed", trainer_ranks=2, zero_stage=stage)
    assert ckpt.read_checked_state(path, dtype="bfloat16", **checked)["step"] == 6
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.read_checked_state(path, dtype="float32", **checked)
    assert str(info.value).startswith(f"checkpoint {path} was written with train.dtype=bfloat16, this "
                                      "run uses float32: DeepSpeed keeps its optimizer state")
    assert "Resume with train.dtype=bfloat16 (auto is bfloat16 only" in str(info.value)


def test_a_truncated_deepspeed_file_is_named(tmp_path):
    path = _deepspeed_folder(tmp_path, ranks=1, stage=2)
    model_file = path / "deepspeed" / "state" / "mp_rank_00_model_states.pt"
    model_file.write_bytes(model_file.read_bytes()[:-40])  # a copy cut short
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.read_checked_state(path, strategy="deepspeed", trainer_ranks=1)
    assert str(info.value).startswith(f"checkpoint file {model_file} is corrupt or truncated (BadZipFile: ")
    # the only checkpoint: deleting it starts the run over, which the advice says
    assert str(info.value).endswith(f"delete the folder {path} and rerun: the run starts over, as no "
                                    "earlier complete checkpoint exists, or point train.resume at another one")


def test_an_fsdp2_checkpoint_without_its_dcp_folder_is_named(tmp_path):
    path = _deepspeed_folder(tmp_path, ranks=1, stage=2)
    shutil.rmtree(path / "deepspeed")
    state = json.loads((path / ckpt.STATE_FILE).read_text())
    (path / ckpt.STATE_FILE).write_text(json.dumps({**state, "strategy": "fsdp2"}))
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.read_checked_state(path, strategy="fsdp2", trainer_ranks=1)
    assert str(info.value) == (f"checkpoint {path} has no dcp/.metadata; it is incomplete: delete it "
                               "and rerun: the run starts over, as no earlier complete checkpoint exists")


# -- 3. an optimizer.json of the wrong shape is named, not a TypeError traceback ----------


@pytest.mark.parametrize("text", ["[]", '{"param_groups": [1], "scalars": {}}', '{"param_groups": []}'])
def test_an_optimizer_json_of_the_wrong_shape_is_refused_naming_it(run, text):
    path = _newest(run)
    (path / "optimizer.json").write_text(text)
    with pytest.raises(ckpt.CheckpointError) as info:
        _trainer(run, steps=6, resume="auto").resume()
    assert str(info.value) == (
        f"checkpoint file {path / 'optimizer.json'} is corrupt or truncated (ValueError: not an object "
        "with 'param_groups' (a list of objects) and 'scalars'); delete the folder "
        f"{path} to resume from the previous complete checkpoint, or point train.resume at another one")


# -- 4. a train.resume word that is neither auto nor never -------------------------------


@pytest.mark.parametrize(("value", "meant"), [("none", "never"), ("Auto", "auto"), ("latest", "auto"),
                                              ("NEVER", "never"), ("runs/x/step_9", None)])
def test_a_resume_value_that_is_no_folder_says_what_the_setting_takes(tmp_path, value, meant):
    with pytest.raises(ckpt.CheckpointError) as info:
        _trainer(tmp_path / "run", resume=value).resume()
    hint = f"; did you mean train.resume={meant}?" if meant else ""
    assert str(info.value) == (f"train.resume: checkpoint folder {value} does not exist (train.resume is "
                               f"auto, never, or the path of a checkpoint folder{hint})")


# -- 5. a resume with train.steps at or below the checkpoint's step ----------------------


@pytest.mark.parametrize("steps", [3, 4])
def test_a_resume_with_no_step_left_says_so_not_which_rate_step_5_gets(run, steps):
    """The note said "step 5 keeps the learning rate 0.000e+00, the steps after it follow the
    new schedule", though the run trains no step 5."""
    trainer = _trainer(run, steps=steps, resume="auto")
    info = trainer.resume()
    assert info.schedule_change == (f"train.steps is {steps} and the checkpoint is at step 4: there is "
                                    "no step left to train; raise train.steps to train further")
    result = trainer.fit(pack(chain_samples(30), 90))
    assert (result.steps_run, result.step, result.checkpoint) == (0, 4, _newest(run))
