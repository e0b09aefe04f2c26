"""``draftforge train RECIPE [key=value ...] [--dry-run] [--nproc N]``: start a SplitServe job.

Loads and validates the recipe and its split before anything starts, then runs
``python -m torch.distributed.run --standalone --nproc_per_node=<world_size>
-m draftforge.train RECIPE [key=value ...]`` (``torchrun``), one process per rank.
``--dry-run`` prints the resolved config, the split, the draft's parameter count
and a per-rank memory estimate, and exits without starting anything.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence

LOOPBACK = "127.0.0.1"


DEFAULT_RESTARTS = 3  # with split.restart_target
RESTART_ENV = "DRAFTFORGE_RESTART"  # which restart of the job the ranks belong to


def torchrun_command(recipe: str, overrides: Sequence[str], nproc: int,
                     master_addr: str = LOOPBACK) -> list[str]:
    """The torchrun command line that starts every rank of the job.

    ``--local-addr`` is the address the ranks are told to reach rank 0 at
    (``MASTER_ADDR``): loopback unless ``--master-addr`` opens it deliberately.
    """
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", f"--local-addr={master_addr}",
        "-m", "draftforge.train", recipe, *overrides,
    ]


def launch_env(master_addr: str = LOOPBACK, *, cpu: bool = True) -> dict[str, str]:
    """The ranks' environment: gloo's sockets on loopback unless the address is opened."""
    env = dict(os.environ)
    if cpu:
        # one intra-op thread per process unless told otherwise: ranks share the cores
        env.setdefault("OMP_NUM_THREADS", "1")
    if master_addr in (LOOPBACK, "localhost") and sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("MASTER_ADDR", master_addr)
    return env


def preflight(cfg) -> None:
    """Checks of the user's files that need no process group, before torchrun starts.

    The checkpoint ``train.resume`` would pick must be readable and built for
    this recipe's draft; the data is read and validated exactly as the target
    ranks will read it (the overlap check is left to them). Raises
    :class:`~draftforge.errors.InputError` (exit status 2) naming the file.
    """
    from pathlib import Path

    from draftforge.splitserve.producer import load_source_conversations
    from draftforge.train import checkpoint as ckpt

    found = ckpt.find_resume(Path(cfg.train.output_dir), cfg.train.resume)
    if found is not None:
        model_config = _model_config(cfg)
        ckpt.read_checked_state(found, model_config=model_config)
    data = cfg.data.model_copy(update={"overlap_check": False})
    conversations, _ = load_source_conversations(cfg.model_copy(update={"data": data}))
    if not conversations:
        from draftforge.data.formats import DataFormatError

        raise DataFormatError(
            f"data.train_files {list(cfg.data.train_files)}: no conversations to train on (the files "
            "are empty, or every row was skipped as invalid); check the files"
        )


def _model_config(cfg) -> dict | None:
    """The draft's DSparkConfig as a dict when the target's shape is known without loading it."""
    from draftforge.splitserve.registry import resolve_target_shape
    from draftforge.train.config import build_dspark_config

    shape = resolve_target_shape(cfg.target)
    if shape is None:
        return None
    return build_dspark_config(cfg.draft, shape, vocab_size=shape.vocab_size).to_dict()


def main(argv: Sequence[str] | None = None) -> int:
    """Validate, then start torchrun (or print the dry run); returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="draftforge train",
        description="Train a DSpark draft against a live target: target ranks stream features "
        "to trainer ranks (the recipe's split section). Rerun the same command to resume.",
    )
    parser.add_argument("recipe", help="path to a recipe YAML file")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. train.steps=100")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved config, split, parameter count and memory estimate")
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes to start; must equal split.world_size (default: that)")
    parser.add_argument("--max-restarts", type=int, default=None,
                        help=f"restarts of the whole job after it fails (default {DEFAULT_RESTARTS} with "
                        "split.restart_target: true, else 0)")
    parser.add_argument("--master-addr", default=LOOPBACK,
                        help="address the ranks reach rank 0 at (default 127.0.0.1, loopback "
                        "only); give this machine's address only to open the job deliberately")
    args = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))

    from draftforge.config import RecipeError, load_recipe
    from draftforge.splitserve.roles import check_split

    cfg = load_recipe(args.recipe, args.overrides)
    if args.nproc is not None and args.nproc != cfg.split.world_size:
        raise RecipeError([
            f"--nproc {args.nproc}: the recipe's split has world_size {cfg.split.world_size} "
            f"(target ranks {cfg.split.target_ranks}, trainer ranks {cfg.split.trainer_ranks}); "
            "drop --nproc or change the split (e.g. split.world_size=N)"
        ])
    # A dry run plans the job for the machine the recipe names: its GPUs need not be here.
    check_split(cfg, cuda_devices=planned_gpus(cfg) if args.dry_run else None)
    preflight(cfg)
    if args.dry_run:
        from draftforge.splitserve.dry_run import dry_run

        print(dry_run(cfg))
        return 0

    restarts = args.max_restarts
    if restarts is None:
        restarts = DEFAULT_RESTARTS if cfg.split.restart_target else 0
    if restarts < 0:
        raise RecipeError([f"--max-restarts {restarts}: give 0 or more"])
    command = torchrun_command(args.recipe, args.overrides, cfg.split.world_size,
                               master_addr=args.master_addr)
    env = launch_env(args.master_addr, cpu=not any(torch_cuda_visible()))
    print(f"draftforge train: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    status = subprocess.call(command, env=env)
    # split.restart_target: a dead rank (a target, usually) ends the job; every rank
    # starts again in a fresh torchrun, exactly as if the user reran the command,
    # and continues from the newest checkpoint (train.resume: auto). (torchrun's own
    # --max-restarts was tried: its restarted ranks often failed gloo's connect.)
    for attempt in range(1, restarts + 1):
        if status == 0:
            break
        print(
            f"draftforge train: the job failed (exit status {status}); restart {attempt} of "
            f"{restarts} (split.restart_target), continuing from the newest checkpoint in "
            f"{cfg.train.output_dir}", file=sys.stderr, flush=True,
        )
        env[RESTART_ENV] = str(attempt)
        status = subprocess.call(command, env=env)
    if status != 0:
        print(
            f"draftforge train: the job failed (exit status {status}); the messages above name "
            f"the failing rank. Rerun the same command to resume from the newest checkpoint in "
            f"{cfg.train.output_dir} (train.resume={cfg.train.resume}).",
            file=sys.stderr,
        )
    return status


def planned_gpus(cfg) -> int:
    """GPUs the recipe's split names (what a dry run assumes); at least one when it wants nccl."""
    devices = (cfg.split.target_devices or []) + (cfg.split.trainer_devices or [])
    if devices:
        return max(devices) + 1
    return cfg.split.world_size if cfg.split.comm_backend == "nccl" else 0


def torch_cuda_visible() -> list[int]:
    """GPU indices torch can see here (empty on CPU machines)."""
    import torch

    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
