"""``draftforge bench train``: the FLOP count it reports and its machine-readable last line."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from trainer_helpers import tiny_model_config

from draftforge.errors import InputError
from draftforge.train import bench_train as bt
from draftforge.train.bench_train import main, step_flops
from draftforge.train.model import DSparkDraft
from draftforge.train.objective import dspark_objective


@pytest.fixture
def keep_threads():
    """The benchmark sets torch's process-wide intra-op threads: give the next test its own back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def small_peak(monkeypatch):
    """The matmul peak on one small size: the real sizes take about 14 s a measurement on one
    thread, and these tests check how the figures are put together, not the peak itself."""
    monkeypatch.setattr(bt, "CPU_PEAK_SIZES", (512,))


def test_vocabulary_flops_match_what_the_fused_objective_executes():
    cfg = tiny_model_config(enable_confidence_head=False, confidence_head_with_markov=False)
    model = DSparkDraft(cfg)
    anchors = [[3, 9, 20], [5]]
    num_blocks = 4
    hidden = torch.randn(num_blocks, cfg.block_size, cfg.hidden_size, requires_grad=True)
    tokens = torch.randint(0, cfg.vocab_size, (num_blocks, cfg.block_size))
    valid = torch.ones(num_blocks, cfg.block_size, dtype=torch.bool)
    target = torch.randn(num_blocks, cfg.block_size, cfg.hidden_size)
    with FlopCounterMode(display=False) as counter:
        out = dspark_objective(model, hidden, tokens, tokens, valid, target, chunk_blocks=3)
        out.loss.backward()
    # Forward + backward of the objective = 3 x the forward vocabulary count: draft, Markov
    # and target logits, the hidden and Markov-latent gradients, the W2 gradient (the batched
    # <sign, p> dot products are elementwise work, not counted).
    mm_flops = counter.get_flop_counts()["Global"][torch.ops.aten.mm]
    assert mm_flops == 3 * step_flops(cfg, seq=32, anchors=anchors)["vocab"]


def test_backbone_flops_by_hand():
    cfg = tiny_model_config()  # H 32, 4 heads of 8, 2 kv heads, FFN 48, 2 layers, block 4, 3 aux layers
    flops = step_flops(cfg, seq=10, anchors=[[2, 5]])
    queries, context = 8, 10
    per_layer = (2 * queries * 32 * (32 + 16 + 16) + 2 * context * 32 * 32 + 2 * queries * 32 * 32
                 + 6 * queries * 32 * 48)
    assert flops["backbone"] == 2 * context * 96 * 32 + 2 * per_layer
    visible = (2 + 4) * 4 + (5 + 4) * 4  # keys each query of the two blocks sees
    assert flops["attention"] == 2 * 4 * 4 * 8 * visible
    fc = 2 * context * 96 * 32
    assert flops["step"] == 3 * flops["forward"] - fc  # fc's input (the features) has no gradient


def test_a_whole_step_executes_the_counted_flops_but_attention(keep_threads):
    """torch's FLOP counter on one real trainer step (float32, eager objective) sees every
    matmul; its total is the count's, less attention, which the counter does not see in
    CPU SDPA. fc counts twice, not three times: the features need no gradient."""
    torch.set_num_threads(1)
    args = bt._parser().parse_args(["--seq", "64", "--anchors", "4", "--steps", "1", "--warmup", "0",
                                    "--compile", "off", "--threads", "1", "--dtype", "float32",
                                    "--device", "cpu"])
    cfg, recipe = bt._model_config(args)
    steps = bt.train_steps(cfg, recipe, args)
    with FlopCounterMode(display=False) as counter:
        _, _, anchors = next(steps)
    counted = step_flops(cfg, seq=64, anchors=anchors)
    executed = sum(counter.get_flop_counts()["Global"].values())
    assert executed == counted["step"] - 3 * counted["attention"]


def test_bench_train_prints_a_machine_readable_last_line(capsys, keep_threads, small_peak):
    assert main(["--seq", "48", "--anchors", "4", "--steps", "1", "--warmup", "1", "--threads", "1"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    fields = dict(item.split("=") for item in last.split())
    assert set(fields) == {"train_mfu", "step_tokens_s"}
    assert 0 < float(fields["train_mfu"]) < 1.5 and float(fields["step_tokens_s"]) > 0


def test_train_mfu_is_the_step_flops_over_seconds_over_the_neighbouring_peak(capsys, keep_threads, monkeypatch):
    """Fixed step times and matmul peaks: each timed step's MFU is its whole step's FLOPs
    (forward and backward) / its seconds / the higher of the peaks measured just before and
    just after it, and train_mfu is their median."""
    anchors = [[3, 10]]  # one sequence, 2 anchors of block 8: 16 block tokens a step
    cfg, _ = bt._model_config(bt._parser().parse_args([]))
    flops = step_flops(cfg, seq=48, anchors=anchors)["step"]
    assert flops > step_flops(cfg, seq=48, anchors=anchors)["forward"] * 2  # the forward alone: ~1/3
    seconds = [9.0, 0.5, 1.0, 2.0]  # one warm-up step, then three timed ones
    peaks = iter([flops, 4 * flops, 2 * flops, 0.8 * flops])  # before the first timed step, after each

    def steps(cfg, recipe, args):
        for s in seconds:
            yield s, 1.0, anchors

    monkeypatch.setattr(bt, "train_steps", steps)
    monkeypatch.setattr(bt, "matmul_peak", lambda **_: next(peaks))
    assert main(["--seq", "48", "--anchors", "2", "--steps", "3", "--warmup", "1", "--threads", "1",
                 "--device", "cpu", "--dtype", "float32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # step peaks max(1, 4) = 4, max(4, 2) = 4, max(2, 0.8) = 2 (x FLOPs): MFU F / 0.5 s / 4F = 0.5,
    # F / 1 s / 4F = 0.25, F / 2 s / 2F = 0.25; the median 0.25; 16 tokens in the median 1 s
    assert [line.rsplit("MFU ", 1)[1] for line in lines if line.startswith("  step") and "MFU" in line] == [
        "0.500", "0.250", "0.250"]
    assert lines[-1] == "train_mfu=0.250 step_tokens_s=16.0"


def test_bench_train_runs_on_the_recipes_threads_and_reports_per_step_mfu(capsys, small_peak):
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-cpu.yaml"
    before, seen = torch.get_num_threads(), []
    real_mm = torch.Tensor.__matmul__

    def matmul(a, b):  # the threads torch computes on while the benchmark runs
        seen.append(torch.get_num_threads())
        return real_mm(a, b)

    try:
        torch.set_num_threads(2)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.Tensor, "__matmul__", matmul)
            # an override after an option is taken too, as train and bench split take it
            assert main([str(recipe), "--seq", "48", "train.num_threads=1", "--anchors", "4", "--steps",
                         "2", "--warmup", "1", "--compile", "off"]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}
    out = capsys.readouterr().out
    # the recipe's dtype: auto, resolved for this CPU
    from draftforge.precision import resolve_dtype

    assert f"{resolve_dtype('auto', cuda=False)}, 1 thread;" in out.splitlines()[0]
    timed = [line for line in out.splitlines() if line.startswith("  step") and "MFU" in line]
    assert len(timed) == 2  # each timed step carries its own ratio against its neighbouring peaks
    per_step = sorted(float(line.rsplit("MFU ", 1)[1]) for line in timed)
    reported = float(out.strip().splitlines()[-1].split()[0].split("=")[1])
    assert abs(reported - sum(per_step) / 2) < 1.5e-3  # the median of two is their mean


def _recipe(name: str):
    from pathlib import Path

    return Path(__file__).resolve().parents[1] / "recipes" / name


def test_bench_train_device_follows_the_option_then_the_recipe(monkeypatch):
    """--device wins; else the recipe's train.device (auto: CUDA when present); cpu without a
    recipe; asking for CUDA where torch sees none is refused with the way out."""
    import argparse

    import pytest

    from draftforge.config import load_recipe
    from draftforge.train.bench_train import resolve_device

    recipe = load_recipe(_recipe("smollm2-cpu.yaml"))
    none = argparse.Namespace(device=None)
    assert resolve_device(none, None) == "cpu"
    assert resolve_device(argparse.Namespace(device="cpu"), recipe) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    auto = load_recipe(_recipe("smollm2-cpu.yaml"), ["train.device=auto"])
    assert resolve_device(none, auto) == "cpu"
    with pytest.raises(InputError, match="--device cpu"):
        resolve_device(argparse.Namespace(device="cuda"), recipe)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(none, auto) == "cuda"


def test_bench_train_memory_estimate_is_the_dry_runs_at_the_bench_shapes():
    """The estimate printed next to the measured CUDA peak is the dry run's trainer-rank
    estimate of the same recipe with the bench's shapes put in by overrides."""
    import argparse

    from draftforge.config import load_recipe
    from draftforge.splitserve.dry_run import draft_parameter_counts, trainer_estimate
    from draftforge.train.bench_train import estimate_for_bench

    path = _recipe("ling3-flash-dspark.yaml")
    args = argparse.Namespace(seq=4096, anchors=256, batch=2, dtype="bfloat16", device="cuda")
    got = estimate_for_bench(load_recipe(path), args)
    cfg = load_recipe(path, ["data.max_length=4096", "train.num_anchors=256", "train.strategy=single",
                             "split.token_budget=8192", "train.grad_accum=1", "train.device=cuda"])
    want = trainer_estimate(cfg, *draft_parameter_counts(cfg))
    # less the received queue: the bench feeds its steps from memory
    assert got.items == [item for item in want.items if not item[0].startswith("received queue")]
    assert len(got.items) == len(want.items) - 1
    assert "trainable params (fp32)" in dict(got.items)  # strategy single: nothing sharded
    assert estimate_for_bench(None, args) is None
    # the smollm2 CPU recipe's trainer may run on a CPU; on the bench's CUDA its CPU-only
    # buffers (W2 group, packed lm_head) are not there, and neither is its queue
    cuda = estimate_for_bench(load_recipe(_recipe("smollm2-cpu.yaml")),
                              argparse.Namespace(seq=512, anchors=64, batch=1, dtype="bfloat16", device="cuda"))
    names = [name for name, _ in cuda.items]
    assert not any("a trainer on a CPU" in name or name.startswith("received queue") for name in names)
    cpu = estimate_for_bench(load_recipe(_recipe("smollm2-cpu.yaml")),
                             argparse.Namespace(seq=512, anchors=64, batch=1, dtype="bfloat16", device="cpu"))
    assert any("a trainer on a CPU" in name for name, _ in cpu.items)
