"""The benchmarks, round 11: bench train's FLOP count of the draft's heads, the peak each timed
step is held against, the options' documented defaults, and bench target's refusal of a model
it cannot build from options alone."""

from __future__ import annotations

import argparse
import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from trainer_helpers import VOCAB, tiny_model_config

from draftforge.cli import main as cli_main
from draftforge.train import bench_train as bt


@pytest.fixture
def keep_threads():
    """The benchmark sets torch's process-wide intra-op threads: give the next test its own back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# A tiny draft: H 32, 4 heads of 8, 2 kv heads of 8, FFN 48, 2 layers, block 4, 3 aux layers
# (features 96), vocabulary VOCAB, Markov rank 8. One sequence of 10 tokens, anchors 2 and 5:
# N = 8 block tokens (queries), S = 10 context positions.
H, Q, KV, FFN, LAYERS, BLOCK, F, R = 32, 32, 16, 48, 2, 4, 96, 8
N, S = 8, 10


def _step_by_hand(markov: str, confidence: str) -> int:
    """The step's FLOPs derived from the module shapes, one matmul at a time (multiply-add = 2).

    Trained weights: forward, input gradient and weight gradient (3 x); fc: forward and weight
    gradient only (its input, the target's features, needs no gradient); the frozen lm_head:
    no weight gradient, and the target's logits have no backward at all."""
    per_layer = (2 * N * H * Q  # q_proj on the block
                 + 2 * 2 * N * H * KV  # k_proj, v_proj on the block
                 + 2 * 2 * S * H * KV  # k_proj, v_proj on the context
                 + 2 * N * Q * H  # o_proj
                 + 3 * 2 * N * H * FFN)  # gate, up, down
    visible = (2 + BLOCK) * BLOCK + (5 + BLOCK) * BLOCK  # keys the queries of each block see
    attention = 2 * 2 * 4 * 8 * visible  # QK^T and PV, 4 heads of 8, per layer
    fc = 2 * S * F * H
    vocab = (2 * N * VOCAB * (H + R)  # [h, latent] @ [lm_head, W2]^T
             + 2 * N * VOCAB * H  # the target's logits, no backward
             + 2 * N * VOCAB * (H + R)  # d/d[h, latent] = grad @ [lm_head, W2]
             + 2 * N * VOCAB * R)  # d/dW2 (no d/dlm_head: frozen)
    markov_proj = {"vanilla": 0,  # a table look-up; its W2 matmul is in the vocabulary part
                   "gated": 2 * N * (H + R) * R,  # gate_proj [h; W1[prev]] -> r
                   "rnn": 2 * N * (R + R + H) * 3 * R}[markov]  # joint_proj [state; W1[prev]; h] -> 3r
    conf = {"none": 0, "plain": 2 * N * H, "with_markov": 2 * N * (H + R)}[confidence]
    return 3 * LAYERS * (per_layer + attention) + 2 * fc + vocab + 3 * (markov_proj + conf)


HEADS = [("vanilla", "with_markov"), ("gated", "with_markov"), ("rnn", "with_markov"),
         ("vanilla", "plain"), ("vanilla", "none")]


def _config(markov: str, confidence: str):
    return tiny_model_config(markov_head_type=markov, enable_confidence_head=confidence != "none",
                             confidence_head_with_markov=confidence == "with_markov")


@pytest.mark.parametrize(("markov", "confidence"), HEADS)
def test_step_flops_equal_a_hand_derivation_from_the_shapes(markov, confidence):
    """The gated and rnn Markov heads' projections were not counted at all, and the confidence
    head was counted as reading [h; W1[prev]] whether it existed or read h alone."""
    cfg = _config(markov, confidence)
    assert bt.step_flops(cfg, seq=S, anchors=[[2, 5]])["step"] == _step_by_hand(markov, confidence)


@pytest.mark.parametrize(("markov", "confidence"), HEADS[1:])
def test_a_real_step_executes_the_counted_flops_whatever_the_heads(markov, confidence, keep_threads):
    """torch's FLOP counter on one trainer step (float32, eager objective): every matmul but
    attention (CPU SDPA is not seen by the counter) is in the count, and nothing else."""
    torch.set_num_threads(1)
    args = bt._parser().parse_args(["--seq", "32", "--anchors", "3", "--steps", "1", "--warmup", "0",
                                    "--compile", "off", "--threads", "1", "--dtype", "float32",
                                    "--device", "cpu"])
    cfg = _config(markov, confidence)
    steps = bt.train_steps(cfg, None, args)
    with FlopCounterMode(display=False) as counter:
        _, _, anchors = next(steps)
    steps.close()
    counted = bt.step_flops(cfg, seq=32, anchors=anchors)
    assert sum(counter.get_flop_counts()["Global"].values()) == counted["step"] - 3 * counted["attention"]


def test_the_first_timed_step_is_held_against_the_peak_measured_just_before_it(capsys, monkeypatch):
    """The "before" peak of the first timed step was measured before the warm-up steps (and the
    trainer's build, and on CUDA the compilation), not just before the step as documented."""
    events: list[str] = []

    def steps(cfg, recipe, args):
        for index in range(args.warmup + args.steps):
            events.append(f"step {index}")
            yield 1.0, 1.0, [[3, 10]]

    def peak(**_):
        events.append("peak")
        return 1e12

    monkeypatch.setattr(bt, "train_steps", steps)
    monkeypatch.setattr(bt, "matmul_peak", peak)
    assert bt.main(["--warmup", "2", "--steps", "2", "--threads", "1", "--device", "cpu",
                    "--dtype", "float32"]) == 0
    assert events == ["step 0", "step 1", "peak", "step 2", "peak", "step 3", "peak"]
    events.clear()
    assert bt.main(["--warmup", "0", "--steps", "1", "--threads", "1", "--device", "cpu",
                    "--dtype", "float32"]) == 0
    assert events == ["peak", "step 0", "peak"]  # no warm-up: measured before the first step


def _options(parser: argparse.ArgumentParser):
    """Every documented option that takes a value, with its help text (%-escapes undone)."""
    for action in parser._actions:
        if action.option_strings and action.nargs != 0 and action.help != argparse.SUPPRESS:
            yield action, (action.help or "").replace("%%", "%")


def _parser_of(name: str) -> argparse.ArgumentParser:
    from draftforge.splitserve import bench_target
    from draftforge.train import bench_objective

    module = {"bench train": bt, "bench objective": bench_objective, "bench target": bench_target}[name]
    return module._parser()


@pytest.mark.parametrize("name", ["bench train", "bench objective", "bench target"])
def test_help_gives_every_options_default(name):
    """bench train's --batch and bench target's --model and --cache-dir did not say their
    defaults; bench train's --chunk-blocks and --compile named only the recipe's."""
    parser = _parser_of(name)
    for action, text in _options(parser):
        assert "default" in text, (name, action.option_strings, text)
        default = action.default
        if isinstance(default, (int, str)) and not isinstance(default, bool):
            shown = {str(default), f"{default:,}" if isinstance(default, int) else default}
            assert any(s in text for s in shown), (name, action.option_strings, text)
    if name == "bench train":  # what applies without a recipe: the objective's own defaults
        from draftforge.train.config import LossConfig

        helps = {a.dest: t for a, t in _options(parser)}
        assert re.search(rf"\b{LossConfig().chunk_blocks} without a recipe", helps["chunk_blocks"])
        assert f"{LossConfig().compile} without a recipe" in helps["compile"]


def test_bench_target_refuses_the_random_model_naming_the_option(capsys):
    """--model random ended in a pydantic ValidationError traceback."""
    assert cli_main(["bench", "target", "--model", "random", "--dtypes", "float32"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "ValidationError" not in err
    assert err.startswith("draftforge bench target: error: --model random:")
    assert "shape" in err


def test_an_override_without_a_recipe_says_it_needs_one(capsys, tmp_path, monkeypatch):
    """The first positional is the recipe, so ``bench train train.num_threads=1`` reported
    "train.num_threads=1: no such recipe file", as if a recipe file were misspelt."""
    monkeypatch.chdir(tmp_path)
    assert cli_main(["bench", "train", "train.num_threads=1", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("draftforge bench train: error: 'train.num_threads=1' is an override")
    assert "RECIPE key=value" in err and "no such recipe file" not in err
