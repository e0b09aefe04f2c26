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


def torchrun_command(recipe: str, overrides: Sequence[str], nproc: int) -> list[str]:
    """The torchrun command line that starts every rank of the job."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", "-m", "draftforge.train", recipe, *overrides,
    ]


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
    check_split(cfg)
    if args.dry_run:
        from draftforge.splitserve.dry_run import dry_run

        print(dry_run(cfg))
        return 0

    command = torchrun_command(args.recipe, args.overrides, cfg.split.world_size)
    env = dict(os.environ)
    if not any(torch_cuda_visible()):
        # one intra-op thread per process unless told otherwise: ranks share the cores
        env.setdefault("OMP_NUM_THREADS", "1")
    print(f"draftforge train: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    status = subprocess.call(command, env=env)
    if status != 0:
        print(
            f"draftforge train: the job failed (exit status {status}); the messages above name "
            f"the failing rank. Rerun the same command to resume from the newest checkpoint in "
            f"{cfg.train.output_dir} (train.resume={cfg.train.resume}).",
            file=sys.stderr,
        )
    return status


def torch_cuda_visible() -> list[int]:
    """GPU indices torch can see here (empty on CPU machines)."""
    import torch

    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
