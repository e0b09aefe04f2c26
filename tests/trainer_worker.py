"""One process of a multi-process trainer test (started by tests/test_trainer_distributed.py).

Reads its job from a JSON file: the world size, which ranks train (the others
idle like target ranks), the strategy and the run. Trainer rank 0 writes the
per-step losses, grad norms and sample ids, and the final full model state.
"""

from __future__ import annotations

import json
import os
import sys
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
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer_ranks = job["trainer_ranks"]
    group = dist.new_group(trainer_ranks) if len(trainer_ranks) < world else dist.group.WORLD
    if rank in trainer_ranks:
        run(job, group, trainer_ranks.index(rank), len(trainer_ranks))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def run(job: dict, group, trainer_rank: int, num_trainers: int) -> None:
    train = train_config(**job["train"])
    model_overrides = job.get("model", {})
    trainer = Trainer(model_config=tiny_model_config(**model_overrides), train=train,
                      embeddings=target_embeddings(), run_dir=Path(job["run_dir"]), group=group,
                      recipe_yaml="job: test\n")
    info = trainer.resume()
    samples = chain_samples(job["num_samples"], nan_ids=tuple(job.get("nan_ids", ())))
    if info is not None:
        samples = [s for s in samples if s.sample_id not in info.all_consumed_ids]
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
