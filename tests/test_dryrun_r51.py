"""Session 51: a dry run on a machine without a GPU plans a GPU recipe's auto dtypes as the GPUs
resolve them."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftforge.config import load_recipe
from draftforge.splitserve.dry_run import dry_run

TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"


@pytest.fixture
def no_native_bf16(monkeypatch):
    """This machine as a login node: no GPU, a CPU without native bf16."""
    import torch

    import draftforge.precision as precision

    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda cpuinfo=None: [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_auto_dtypes_of_gpu_ranks_are_planned_as_bfloat16(no_native_bf16):
    """Loading resolved auto by this CPU (float32), and the dry run, which plans for the machine
    the recipe names, showed float32 weights and trainer memory for GPU ranks: twice the bytes."""
    cfg = load_recipe(TINY, ["split.comm_backend=nccl", "target.dtype=auto", "train.dtype=auto"])
    assert (cfg.target.dtype_on("cuda"), cfg.train.dtype) == ("float32", "float32")  # this CPU's rule
    report = dry_run(cfg)
    assert "target.dtype and train.dtype: auto, planned as bfloat16 for the recipe's GPUs" in report
    assert "weights (bfloat16" in report and "weights (float32" not in report
    # the trainers' estimate is bf16's too: as a recipe saying bfloat16 gets it
    explicit = dry_run(load_recipe(TINY, ["split.comm_backend=nccl", "target.dtype=bfloat16", "train.dtype=bfloat16"]))
    trainer = "memory estimate per trainer rank:"
    assert report.split(trainer)[1] == explicit.split(trainer)[1]


def test_ranks_on_a_cpu_and_explicit_dtypes_keep_theirs(no_native_bf16):
    report = dry_run(load_recipe(TINY, ["split.comm_backend=gloo", "train.device=cpu", "target.dtype=auto",
                                        "train.dtype=auto"]))
    assert "planned as bfloat16" not in report and "weights (float32" in report
    report = dry_run(load_recipe(TINY, ["split.comm_backend=nccl", "target.dtype=float32", "train.dtype=float32"]))
    assert "planned as bfloat16" not in report and "weights (float32" in report


def test_no_generation_memory_where_the_answers_file_exists(tmp_path):
    """The target's estimate counted a generation KV cache whenever data.regenerate was set, also
    where training reads answers written ahead (the demo's way) and generates nothing."""
    from draftforge.splitserve.dry_run import target_estimate

    overrides = ["data.regenerate=true", f"train.output_dir={tmp_path / 'run'}"]
    kv = "generation: KV cache + logits"
    assert any(name.startswith(kv) for name, _ in target_estimate(load_recipe(TINY, overrides)).items)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "regenerated.jsonl").write_text("")
    assert not any(name.startswith(kv) for name, _ in target_estimate(load_recipe(TINY, overrides)).items)


def test_eval_device_auto_takes_one_target_groups_gpus_from_a_device_list(monkeypatch):
    """With split.target_devices, eval --device auto spread the target over every target rank's
    GPU (two data-parallel targets' worth), where without the list it took the first
    tensor-parallel group's; the error for an absent GPU blamed the list also where there was none."""
    import types

    from draftforge.errors import InputError
    from draftforge.splitserve.placement import recipe_target_gpus, resolve_devices

    split = types.SimpleNamespace(target_ranks=[0, 1, 2, 3], target_devices=[4, 5, 6, 7], target_tensor_parallel=2,
                                  world_size=8, num_nodes=1)
    assert recipe_target_gpus(split) == [4, 5]
    listless = types.SimpleNamespace(**{**vars(split), "target_devices": None})
    assert recipe_target_gpus(listless) == [0, 1]
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine of two GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(InputError, match=r"the recipe's first target group runs on GPU\(s\) \[4, 5\] "
                                         r"\(split.target_devices, else its ranks' LOCAL_RANK\)"):
        resolve_devices("auto", [4, 5])


def test_the_default_comm_backend_plans_both_groups_alike(no_native_bf16):
    """With split.comm_backend auto (nccl where GPUs are visible) only the target's dtype was
    planned for GPUs, though the report places both groups on them."""
    report = dry_run(load_recipe(TINY, ["split.comm_backend=auto", "target.dtype=auto", "train.dtype=auto"]))
    assert "target.dtype and train.dtype: auto, planned as bfloat16" in report
