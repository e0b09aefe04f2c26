"""One process of a multi-process trainer test (started by tests/test_trainer_distributed.py).

Reads its job from a JSON file: the world size, which ranks train (the others
idle like target ranks), the strategy and the run. Trainer rank 0 writes the
per-step losses, grad norms and sample ids, and the final full model state. A rank
that raises writes its error (type, message, seconds since it started, step) to
``OUT.rankR.error`` first, then fails.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_helpers import (  # noqa: E402
    chain_samples,
    target_embeddings,
    tiny_model_config,
    train_config,
)

from draftforge.train.sample import pack  # noqa: E402
from draftforge.train.trainer import Trainer  # noqa: E402


class Crash(RuntimeError):
    pass


def main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    timeout = job.get("pg_timeout_s")  # short in tests where a regression would hang
    dist.init_process_group("gloo", **({"timeout": timedelta(seconds=timeout)} if timeout else {}))
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer_ranks = job["trainer_ranks"]
    group = dist.new_group(trainer_ranks) if len(trainer_ranks) < world else dist.group.WORLD
    if rank in trainer_ranks:
        run(job, group, trainer_ranks.index(rank), len(trainer_ranks))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _fail_saves(trainer: Trainer, where: str) -> None:
    """This rank's checkpoint writes fail as on a full disk: DeepSpeed's optimizer shard,
    (``where="dcp"``) fsdp2's DCP files, or the RNG file that every rank writes."""
    from draftforge.train import checkpoint as ckpt

    def full(path) -> OSError:
        return OSError(errno.ENOSPC, "No space left on device", str(path))

    if where == "dcp":
        import torch.distributed.checkpoint.filesystem as dcp_files

        def write_item(*args, **kwargs):
            raise full("dcp item")

        dcp_files._write_item = write_item
        return
    if trainer.engine is not None:
        original = trainer.engine.checkpoint_engine.save

        def save(state_dict, path):
            if "optim_states" in str(path):
                raise full(path)
            return original(state_dict, path)

        trainer.engine.checkpoint_engine.save = save
        return

    def save_file(tensors, path, *args, **kwargs):
        raise full(path)

    ckpt.save_file = save_file


def run(job: dict, group, trainer_rank: int, num_trainers: int) -> None:
    started = time.monotonic()
    built: list[Trainer] = []
    try:
        _run(job, group, trainer_rank, num_trainers, built)
    except Exception as exc:  # recorded for the test, then the process fails as it would
        error = {"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - started,
                 "step": built[0].step if built else None}
        Path(f"{job['out']}.rank{trainer_rank}.error").write_text(json.dumps(error))
        raise


def _run(job: dict, group, trainer_rank: int, num_trainers: int, built: list) -> None:
    train = train_config(**job["train"])
    model_overrides = job.get("model", {})
    run_dir = Path(job["run_dir"])
    if job.get("rank_dirs"):  # node-local storage: the same relative output_dir on each rank
        (run_dir / f"node{trainer_rank}").mkdir(parents=True, exist_ok=True)
        os.chdir(run_dir / f"node{trainer_rank}")
        run_dir = Path("run")
    trainer = Trainer(model_config=tiny_model_config(**model_overrides), train=train,
                      embeddings=target_embeddings(job.get("embeddings_seed", 7)), run_dir=run_dir, group=group,
                      recipe_yaml="job: test\n")
    built.append(trainer)
    if job.get("fail_save_rank") == trainer_rank:
        _fail_saves(trainer, job.get("fail_in", ""))
    info = trainer.resume()
    samples = chain_samples(job["num_samples"], nan_ids=tuple(job.get("nan_ids", ())))
    if info is not None:
        samples = [s for s in samples if s.sample_id not in info.all_consumed]
    batches = pack(samples, job["token_budget"])[trainer_rank::num_trainers]
    crash_at = job.get("crash_at")

    def on_step(record):
        if crash_at is not None and record["step"] == crash_at:
            raise Crash(f"simulated crash at step {crash_at}")

    records = []
    try:
        result = trainer.fit(batches, on_step=lambda r: (records.append(r), on_step(r)),
                             extra_state=lambda: {"rank": trainer_rank})
    except Crash:
        result = None
    state = trainer.full_state_dict() if result is not None else {}
    if trainer_rank == 0:
        out = {
            "losses": [r["loss"] for r in records],
            "grad_norms": [r["grad_norm"] for r in records],
            "sample_ids": [r["sample_ids"] for r in records],
            "steps": [r["step"] for r in records],
            "skipped": [r["skipped"] for r in records],
            "resumed_step": None if info is None else info.step,
            "resumed_extra": None if info is None else info.extra,
            "stopped_reason": None if result is None else result.stopped_reason,
            "optimizer_change": None if info is None else info.optimizer_change,
            "param_groups": [{k: g[k] for k in ("weight_decay", "betas", "eps")}
                             for g in trainer.optimizer.param_groups],
        }
        Path(job["out"]).write_text(json.dumps(out))
        if state:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state.items()}, job["out"] + ".safetensors")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from draftforge.train.__main__ import exit_now  # no C++ teardown after the results are written

    exit_now(main(sys.argv[1]))
