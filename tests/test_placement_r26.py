"""The split's placement and its dry run (review round 26): what the dry run prints for each
group's devices matches where the ranks run, and the trainer's memory counts a step's
micro-batches."""

from __future__ import annotations

from pathlib import Path

from splitserve_helpers import tiny_recipe

from draftforge.config import load_recipe

ROOT = Path(__file__).resolve().parents[1]


def _split_lines(report: str) -> list[str]:
    lines = report.splitlines()
    start = lines.index("split:", lines.index("split:") + 1)  # the report's, after the YAML's
    return lines[start + 1:start + 4]


def test_a_steps_micro_batches_are_all_held_in_the_trainer_estimate(tmp_path):
    """train.grad_accum 4: the trainer collates the step's 4 micro-batches before the first
    forward, so 4 x token_budget 256 tokens of bf16 features, 3 captured layers + the final
    state of hidden 64 each, are held at once."""
    from draftforge.splitserve.dry_run import trainer_estimate

    recipe = tiny_recipe(tmp_path)
    one = load_recipe(recipe)
    four = load_recipe(recipe, ["train.grad_accum=4"])

    def features(cfg) -> float:
        items = {name.split(" (")[0]: value for name, value in trainer_estimate(cfg, 10_000, 1_000).items}
        return items["batch features"]

    assert features(one) == 256 * 4 * 64 * 2
    assert features(four) == 4 * 256 * 4 * 64 * 2


def test_the_dry_run_prints_the_devices_the_ranks_run_on(tmp_path):
    """Without device lists, over NCCL each rank of one node takes GPU LOCAL_RANK = its rank
    (the dry run said 'cpu/auto'); over gloo target ranks run on the CPU, also on several
    nodes (the dry run said 'node-local GPU LOCAL_RANK')."""
    from draftforge.splitserve.dry_run import dry_run

    recipe = tiny_recipe(tmp_path, trainers=2)
    nccl = load_recipe(recipe, ["split.comm_backend=nccl", "train.device=cuda"])
    assert _split_lines(dry_run(nccl)) == [
        "  world size 3; comm backend nccl",
        "  target ranks [0] (tensor parallel 1, GPUs [0] (LOCAL_RANK))",
        "  trainer ranks [1, 2] (strategy fsdp2, GPUs [1, 2] (LOCAL_RANK))",
    ]
    named = load_recipe(recipe, ["split.comm_backend=nccl", "train.device=cuda",
                                 "split.target_devices=[2]", "split.trainer_devices=[0,1]"])
    assert _split_lines(dry_run(named))[1:] == [
        "  target ranks [0] (tensor parallel 1, devices [2])",
        "  trainer ranks [1, 2] (strategy fsdp2, devices [0, 1])",
    ]
    gloo = load_recipe(recipe, ["split.target_ranks=[0,1]", "split.trainer_ranks=[2,3]",
                                "split.num_nodes=2", "split.comm_backend=gloo"])
    assert _split_lines(dry_run(gloo)) == [
        "  world size 4 over 2 nodes; comm backend gloo",
        "  target ranks [0, 1] (tensor parallel 1, cpu)",
        "  trainer ranks [2, 3] (strategy fsdp2, cpu)",
    ]


def test_the_trainer_group_is_derived_from_its_device_list(tmp_path):
    """target_ranks [0, 1] on GPUs 0-1 and trainer_devices [2, 3, 4] without trainer_ranks or
    world_size: three trainer ranks 2, 3, 4 (world size 5), one per listed GPU. The loader
    derived one trainer rank and refused the three devices as too many for it."""
    recipe = tiny_recipe(tmp_path, overrides={"split.trainer_ranks": None})
    cfg = load_recipe(recipe, ["split.target_ranks=[0,1]", "split.target_devices=[0,1]",
                               "split.trainer_devices=[2,3,4]", "train.strategy=fsdp2"])
    assert cfg.split.trainer_ranks == [2, 3, 4]
    assert cfg.split.world_size == 5
    # without device lists the default stays one trainer rank after the target ranks
    assert load_recipe(recipe, ["split.target_ranks=[0,1]"]).split.trainer_ranks == [2]


def test_a_gloo_target_ranks_weights_take_the_cpus_dtype(tmp_path, monkeypatch):
    """target.dtype auto, loaded on a machine with a bf16 GPU, resolves to bfloat16; but over
    gloo the target rank runs on the CPU, here one without native bf16, in float32 (4 bytes a
    parameter, not 2)."""
    import torch

    from draftforge import precision
    from draftforge.splitserve.dry_run import target_estimate, target_parameters
    from draftforge.splitserve.registry import resolve_target_shape

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda cpuinfo=None: [])
    cfg = load_recipe(tiny_recipe(tmp_path), ["target.dtype=auto", "split.comm_backend=gloo"])
    assert cfg.target.dtype == "bfloat16"
    params = target_parameters(resolve_target_shape(cfg.target))
    weights = [(n, v) for n, v in target_estimate(cfg).items if n.startswith("weights")]
    assert weights == [(f"weights (float32, tp 1, {params:,} params, dense estimate)", params * 4)]
