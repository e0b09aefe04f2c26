"""Atomic training checkpoints: model, optimizer, schedule, RNG states and the data cursor.

Layout of ``run_dir/checkpoints/step_XXXXXXXX``::

    trainer_state.json    step, skipped steps, schedule, consumed sample ids per
                          trainer rank, the caller's extra state
    rng/rank_R.safetensors  torch RNG state of trainer rank R
    model.safetensors     single: the full model state
    optimizer.safetensors single: AdamW moments (+ optimizer.json, its param groups)
    dcp/                  fsdp2: model + optimizer through torch.distributed.checkpoint
    deepspeed/            deepspeed: the engine's own checkpoint
    COMPLETE              written last

Every rank writes into ``step_XXXXXXXX.tmp``; trainer rank 0 writes the state
and the ``COMPLETE`` marker, then renames the folder: a checkpoint without its
marker (or a ``.tmp`` folder) is never picked by resume. Nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftforge.train import distributed as D

COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoints_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoints_root(run_dir) / f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    return (Path(path) / COMPLETE).is_file() and (Path(path) / STATE_FILE).is_file()


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of ``run_dir``, oldest first."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and is_complete(p)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def find_resume(run_dir: Path, resume: str) -> Path | None:
    """The checkpoint ``train.resume`` asks for: ``auto`` (newest complete, or none), ``never``, or a path."""
    if resume == "never":
        return None
    if resume == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"train.resume: checkpoint folder {path} does not exist")
    if not is_complete(path):
        raise ValueError(
            f"train.resume: {path} is not a complete checkpoint (no {COMPLETE} marker); "
            "pick another one or use train.resume=auto"
        )
    return path


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def read_state(path: Path) -> dict:
    return json.loads((Path(path) / STATE_FILE).read_text())


# -- optimizer state <-> flat tensors (single strategy) ---------------------------------


def _flatten_optimizer(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, scalars = {}, {}
    for index, entries in state_dict["state"].items():
        for key, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"state.{index}.{key}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{index}.{key}"] = value
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()}
        for group in state_dict["param_groups"]
    ]
    return tensors, {"param_groups": groups, "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    for name, value in meta["scalars"].items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    groups = [
        {k: (tuple(v) if k == "betas" else v) for k, v in group.items()} for group in meta["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


# -- save / load ------------------------------------------------------------------------


def save_checkpoint(
    *,
    run_dir: Path,
    step: int,
    strategy: str,
    model,
    optimizer,
    engine,
    state: dict,
    group,
    keep_last: int,
) -> Path:
    """Write the checkpoint of ``step`` atomically (collective over the trainer group)."""
    rank = D.group_rank(group=group)
    final = checkpoint_path(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    D.barrier(group=group)
    save_file({"cpu": torch.get_rng_state()}, str(tmp / "rng" / f"rank_{rank}.safetensors"))
    if strategy == "single":
        model_state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(model_state, str(tmp / "model.safetensors"))
        tensors, meta = _flatten_optimizer(optimizer.state_dict())
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        _write_json(tmp / "optimizer.json", meta)
    elif strategy == "fsdp2":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp / "dcp"),
                 process_group=group)
    elif strategy == "deepspeed":
        engine.save_checkpoint(str(tmp / "deepspeed"), tag="state", save_latest=False)
    else:
        raise ValueError(f"unknown strategy {strategy!r}")
    D.barrier(group=group)
    if rank == 0:
        _write_json(tmp / STATE_FILE, state)
        (tmp / COMPLETE).write_text(f"step {step}\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in complete_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    D.barrier(group=group)
    return final


def load_checkpoint(*, path: Path, strategy: str, model, optimizer, engine, group) -> dict:
    """Restore model, optimizer and this rank's RNG from ``path``; returns the trainer state."""
    path = Path(path)
    state = read_state(path)
    saved_size = len(state.get("consumed_ids", [[]]))
    size = D.group_size(group=group)
    if saved_size != size:
        raise ValueError(
            f"checkpoint {path} was written by {saved_size} trainer rank(s); this run has {size}. "
            "Resume with the same number of trainer ranks."
        )
    if state.get("strategy") != strategy:
        raise ValueError(
            f"checkpoint {path} was written with train.strategy={state.get('strategy')!r}, "
            f"this run uses {strategy!r}"
        )
    rank = D.group_rank(group=group)
    rng_file = path / "rng" / f"rank_{rank}.safetensors"
    if rng_file.is_file():
        torch.set_rng_state(load_file(str(rng_file))["cpu"])
    if strategy == "single":
        loaded = load_file(str(path / "model.safetensors"))
        model.load_state_dict(loaded, strict=True)
        meta = json.loads((path / "optimizer.json").read_text())
        optimizer.load_state_dict(_unflatten_optimizer(load_file(str(path / "optimizer.safetensors")), meta))
    elif strategy == "fsdp2":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        target = {"model": model_state, "optimizer": optim_state}
        dcp.load(target, checkpoint_id=str(path / "dcp"), process_group=group)
        set_state_dict(model, optimizer, model_state_dict=target["model"],
                       optim_state_dict=target["optimizer"])
    elif strategy == "deepspeed":
        load_path, _ = engine.load_checkpoint(str(path / "deepspeed"), tag="state",
                                              load_optimizer_states=True, load_lr_scheduler_states=False)
        if load_path is None:
            raise ValueError(f"deepspeed could not load the checkpoint in {path / 'deepspeed'}")
    return state
