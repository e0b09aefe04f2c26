"""A whole ``draftforge train`` job with SGLang 0.5.23 itself serving the target on the CPU.

Opt-in like the other real-SGLang CPU cases (``DRAFTFORGE_SGLANG_CPU=1``; ``make
sglang-cpu-check`` builds the venv). A module of its own: pytest keeps a module's fixtures
until the module ends, and the SGLang instances of ``test_sglang_backend.py``'s CPU
fixtures beside this job's four filled the machine's memory (the OOM killer took one of
the job's SGLang ranks).
"""

from __future__ import annotations

import os

from test_sglang_backend import cpu_sglang


@cpu_sglang
def test_draftforge_train_with_a_tensor_parallel_sglang_target_on_cpu(tmp_path):
    """The whole job, as a user starts it: SmolLM2 served by SGLang over target ranks 0 and 1
    (one tensor-parallel-2 group, rank 0 leading), one trainer. Under torchrun this hung
    before the first sample until SGLang's ranks stopped inheriting torchrun's store."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = tmp_path / "run"
    overrides = [
        "target.backend=sglang", "split.target_ranks=[0,1]", "split.trainer_ranks=[2]",
        "split.target_tensor_parallel=2", "split.max_in_flight=4", "data.num_samples=8",
        "data.overlap_check=false", "target.generation.max_new_tokens=32",
        "target.generation.batch_size=4", "train.steps=4", "train.log_interval=2",
        "train.checkpoint_interval=2", f"train.output_dir={run}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "draftforge", "train", str(root / "recipes" / "smollm2-cpu.yaml"),
         *overrides],
        cwd=root, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=1200,
    )
    log = done.stderr + done.stdout
    assert done.returncode == 0, log[-4000:]
    assert "[rank 1 target] tensor-parallel member of target rank 0's group" in log
    assert "[rank 1 target] the group's leader is done" in log
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if '"step"' in line]
    assert steps == [1, 2, 3, 4]
    assert (run / "checkpoints" / "step_00000004").is_dir()
