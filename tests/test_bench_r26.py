"""The benchmarks, round 26: bench train's memory estimate at the objective chunk the steps ran
with, its summary saying when no warm-up step kept first-call costs out of the timing, and bench
objective's child running with the allocator settings of every draftforge process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftforge.train import bench_objective as bo
from draftforge.train import bench_train as bt

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.fixture
def keep_threads():
    """The benchmarks set torch's process-wide intra-op threads: give the next test its own back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_memory_estimate_counts_the_objective_chunk_the_steps_ran_with(capsys):
    """--chunk-blocks 8 ran the steps with 8-block objective chunks, but the estimate printed
    beside the measured CUDA peak was the dry run's at the recipe's chunk_blocks (32): 0.45 GiB
    more at Ling-3.0-flash's vocabulary, in the measured/estimate ratio too."""
    from draftforge.config import load_recipe
    from draftforge.splitserve.dry_run import GIB, draft_parameter_counts, trainer_estimate

    path = RECIPES / "ling3-flash-dspark.yaml"
    args = bt._parser().parse_args([str(path), "--seq", "4096", "--anchors", "256", "--chunk-blocks", "8"])
    args.dtype, args.device = "bfloat16", "cuda"  # resolved as main resolves them; printed on CUDA only
    recipe = load_recipe(path)
    assert recipe.train.loss.chunk_blocks != 8
    bt._print_memory(recipe, args, 10 * GIB)
    line = capsys.readouterr().out
    want = load_recipe(path, ["data.max_length=4096", "train.num_anchors=256", "train.strategy=single",
                              "split.token_budget=4096", "train.dtype=bfloat16", "train.loss.chunk_blocks=8",
                              "train.grad_accum=1", "train.device=cuda"])
    total = sum(value for name, value in trainer_estimate(want, *draft_parameter_counts(want)).items
                if not name.startswith("received queue"))  # the bench has no queue
    assert f"(strategy single) {total / GIB:.2f} GiB, measured/estimate {10 * GIB / total:.2f}" in line


def _fixed_run(monkeypatch, capsys, warmup: int) -> list[str]:
    def steps(cfg, recipe, args):
        for _ in range(args.warmup + args.steps):
            yield 1.0, 1.0, [[3, 10]]

    monkeypatch.setattr(bt, "train_steps", steps)
    monkeypatch.setattr(bt, "matmul_peak", lambda **_: 1e12)
    assert bt.main(["--warmup", str(warmup), "--steps", "2", "--threads", "1", "--device", "cpu",
                    "--dtype", "float32"]) == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("warmup", [0, 1])
def test_the_summary_says_when_no_warm_up_step_took_the_first_call_costs(monkeypatch, capsys, keep_threads,
                                                                      warmup):
    """--warmup 0 timed the first step with its first-call costs (and, with the objective
    compiled, the compilation --compile's help places in the warm-up steps), and nothing in
    the report said so."""
    summary = next(line for line in _fixed_run(monkeypatch, capsys, warmup) if line.startswith("step "))
    assert summary.startswith("step 1.000 s (median of 2")
    assert ("no warm-up: the first step's first-call costs and any compilation are in it" in summary) == (
        warmup == 0)


def test_the_objective_child_applies_the_allocator_settings_of_every_draftforge_process(monkeypatch, capsys,
                                                                                      keep_threads):
    """The child is started as ``python -m draftforge.train.bench_objective``, not through the
    CLI, which tunes glibc's allocator for every command (a trainer rank's entry point does too):
    the objective's peak memory and time were measured under glibc's defaults, unlike a
    trainer's."""
    import draftforge.allocator

    calls: list[str] = []

    def child(args):
        calls.append("objective")
        return {"path": args.path}

    monkeypatch.setattr(draftforge.allocator, "tune_malloc", lambda: calls.append("tune_malloc") or True)
    monkeypatch.setattr(bo, "_child", child)
    assert bo.main(["--path", "chunked", "--threads", "1"]) == 0
    assert calls == ["tune_malloc", "objective"]
    assert json.loads(capsys.readouterr().out) == {"path": "chunked"}
