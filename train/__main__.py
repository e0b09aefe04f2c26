"""``python -m draftforge.train RECIPE [key=value ...]``: one rank of a SplitServe job.

Started once per rank by ``draftforge train RECIPE`` (one process per rank, with a
loopback-only store) or by torchrun (``torchrun --nproc_per_node=N -m draftforge.train
RECIPE``). This entry only parses, seeds and hands off to
:func:`draftforge.splitserve.roles.run_rank`.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the recipe and overrides, seed this rank, run it."""
    parser = argparse.ArgumentParser(
        prog="python -m draftforge.train",
        description="One rank of a SplitServe training job (start it with torchrun or draftforge train).",
    )
    parser.add_argument("recipe", metavar="RECIPE", help="path to a recipe YAML file")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="e.g. train.steps=100")
    parser.add_argument("--bench-split", metavar="JSON", default=None, help=argparse.SUPPRESS)
    args = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return _run(args)
    except KeyboardInterrupt as stop:
        # Ctrl-C (or SIGTERM, once run_rank handles it) while the rank starts (loading the
        # recipe, waiting for its peers): one line, as run_rank says once started, not a
        # traceback from every rank
        from draftforge.splitserve.roles import Terminated, die_of_sigterm

        terminated = isinstance(stop, Terminated)
        print(f"[rank {os.environ.get('RANK', '?')}] {'stopped on SIGTERM' if terminated else 'interrupted'}",
              file=sys.stderr, flush=True)
        if terminated:
            die_of_sigterm()
        return 130


def _run(args: argparse.Namespace) -> int:
    """Load the recipe, seed this rank, run it; an input the rank refuses exits with 2."""
    import torch

    from draftforge.config import RecipeError, load_recipe
    from draftforge.splitserve.roles import note_input_error, run_rank

    try:
        cfg = load_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        print(f"draftforge train: invalid recipe:\n{exc}", file=sys.stderr)
        note_input_error(exc)  # so a node's launcher does not restart it
        return 2
    from draftforge.allocator import tune_malloc
    from draftforge.errors import InputError
    from draftforge.splitserve.packed_linear import packing_enabled

    try:
        tune_malloc()
        packing_enabled()
    except InputError as exc:
        print(f"draftforge train: error: {exc}", file=sys.stderr)
        note_input_error(exc)  # so a node's launcher does not restart it
        return 2
    rank = int(os.environ.get("RANK", "0"))
    seed = cfg.train.seed * 1000 + rank
    random.seed(seed)
    torch.manual_seed(seed)
    bench = None
    if args.bench_split is not None:
        import json

        bench = json.loads(args.bench_split)
    try:
        return run_rank(cfg, bench=bench)
    except RecipeError as exc:
        print(f"draftforge train: invalid recipe:\n{exc}", file=sys.stderr)
        note_input_error(exc)  # so a node's launcher does not restart it
        return 2
    except InputError as exc:  # e.g. started without torchrun's environment
        print(f"draftforge train: error: {exc}", file=sys.stderr)
        note_input_error(exc)
        return 2


def exit_now(code: int) -> None:
    """Leave without running C++ static destructors. After a complete run (metrics, checkpoints
    and loggers already closed, the process group destroyed) DeepSpeed ZeRO-3 over gloo has
    been seen to abort in interpreter teardown ("terminate called without an active
    exception"), which would turn a finished rank into a failed one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
