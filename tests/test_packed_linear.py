"""Packed bf16 linear weights (splitserve/packed_linear.py): the same bits as F.linear, or not used."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draftforge.errors import InputError
from draftforge.splitserve import packed_linear
from draftforge.splitserve.packed_linear import pack_linear_weights

needs_ops = pytest.mark.skipif(not packed_linear._ops_available(),
                               reason="this torch build has no oneDNN linear packing ops")


def _linears(dtype=torch.bfloat16, bias=False) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96, bias=bias), nn.SiLU(), nn.Linear(96, 64, bias=bias)).to(dtype)


@needs_ops
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linears_give_f_linears_bits_at_every_batch_shape(bias):
    model = _linears(bias=bias)
    x = torch.randn(3, 17, 64).to(torch.bfloat16)
    with torch.no_grad():
        expected = [model(x[:, :n]) for n in (1, 9, 17)]
        assert pack_linear_weights(model) == 2
        assert all("_draftforge_packed" in m.__dict__ for m in model if isinstance(m, nn.Linear))
        for n, want in zip((1, 9, 17), expected, strict=True):
            assert torch.equal(model(x[:, :n]), want)
    assert pack_linear_weights(model) == 0  # packed already: left as it is


@needs_ops
def test_the_real_target_generates_and_captures_the_same_with_and_without_packing(monkeypatch):
    """SmolLM2-135M-Instruct in bf16 on the CPU, as the CPU recipe's target rank runs it."""
    from draftforge.splitserve.config import GenerationConfig, TargetConfig
    from draftforge.splitserve.target import build_target

    conversations = [[{"role": "user", "content": text}] for text in
                     ("Write a haiku about rivers.", "What is 17 * 23? Show the steps.",
                      "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\nComplete this function.")]
    settings = GenerationConfig(temperature=0.7, max_new_tokens=24, batch_size=3, seed=5)
    results = {}
    for setting in ("on", "off"):
        monkeypatch.setenv(packed_linear.ENV, setting)
        target = build_target(TargetConfig(model="smollm2-135m-instruct", dtype="bfloat16"), [1, 14, 27])
        assert (target.packed_linears > 0) == (setting == "on")
        replies = target.generate_token_ids(conversations, settings)
        rows = torch.tensor([reply[:20] for reply in replies])
        results[setting] = (replies, target.features(rows))
    assert results["on"][0] == results["off"][0]
    packed, plain = results["on"][1], results["off"][1]
    assert torch.equal(packed.aux, plain.aux) and torch.equal(packed.final, plain.final)


@needs_ops
def test_a_weight_changed_after_packing_is_used_not_its_stale_packed_copy():
    model = _linears()
    pack_linear_weights(model)
    x = torch.randn(4, 64).to(torch.bfloat16)
    first = model[0]
    with torch.no_grad():
        first.weight.mul_(2.0)  # in place: the version counter moves
        assert torch.equal(first(x), F.linear(x, first.weight))
        first.weight = nn.Parameter(torch.randn(96, 64).to(torch.bfloat16))  # replaced
        assert torch.equal(first(x), F.linear(x, first.weight))


@needs_ops
def test_with_gradients_enabled_the_forward_is_f_linear_and_differentiable():
    model = _linears()
    pack_linear_weights(model)
    x = torch.randn(4, 64).to(torch.bfloat16)
    model(x).float().sum().backward()
    assert model[0].weight.grad is not None and model[0].weight.grad.abs().sum() > 0


@needs_ops
def test_a_shape_whose_packed_result_differs_in_a_bit_is_not_packed(monkeypatch):
    real = packed_linear._packed_linear

    def off_by_a_bit(x, packed, bias):
        out = real(x, packed, bias)
        return out + torch.finfo(out.dtype).eps * out.abs().max()

    monkeypatch.setattr(packed_linear, "_packed_linear", off_by_a_bit)
    model = _linears()
    assert pack_linear_weights(model) == 0
    assert not any("_draftforge_packed" in m.__dict__ for m in model)


@needs_ops
def test_nothing_is_packed_when_the_copy_would_take_over_a_quarter_of_available_memory(monkeypatch):
    model = _linears()
    weights = sum(m.weight.nbytes for m in model if isinstance(m, nn.Linear))
    monkeypatch.setattr(packed_linear, "_available_bytes", lambda: 4 * weights - 1)
    assert pack_linear_weights(model) == 0
    monkeypatch.setattr(packed_linear, "_available_bytes", lambda: 4 * weights)
    assert pack_linear_weights(model) == 2


def test_float32_weights_are_never_packed():
    assert pack_linear_weights(_linears(torch.float32)) == 0


def test_the_setting_is_on_or_off(monkeypatch):
    monkeypatch.setenv(packed_linear.ENV, "off")
    assert pack_linear_weights(_linears()) == 0
    monkeypatch.setenv(packed_linear.ENV, "yes")
    with pytest.raises(InputError, match=r"DRAFTFORGE_PACKED_LINEAR='yes': expected 'on' \(the default\) or 'off'"):
        pack_linear_weights(_linears())


@pytest.mark.parametrize("entry", [["-m", "draftforge", "config", "show"], ["-m", "draftforge.train"]])
def test_commands_refuse_a_bad_setting_at_start_without_a_traceback(entry):
    """Checked when a command starts, not first when a target loads inside a rank or worker."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-cpu.yaml"
    env = dict(os.environ, DRAFTFORGE_PACKED_LINEAR="fast", RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    result = subprocess.run([sys.executable, *entry, str(recipe)], capture_output=True, text=True,
                            env=env, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    assert "DRAFTFORGE_PACKED_LINEAR='fast'" in result.stderr and "Traceback" not in result.stderr


@needs_ops
def test_the_dry_run_counts_the_packed_copy_as_large_as_the_real_target_packs_it(monkeypatch):
    from pathlib import Path

    from draftforge.config import load_recipe
    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.dry_run import packed_weights_bytes, target_estimate
    from draftforge.splitserve.target import build_target

    monkeypatch.setenv(packed_linear.ENV, "on")
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-cpu.yaml"
    bf16 = load_recipe(recipe, ["target.dtype=bfloat16"])
    target = build_target(TargetConfig(model="smollm2-135m-instruct", dtype="bfloat16"), [1, 14, 27])
    packed = sum(m.weight.nbytes for m in target.model.modules() if "_draftforge_packed" in m.__dict__)
    assert target.packed_linears == 211  # 30 layers x 7 projections, and the lm_head
    assert packed_weights_bytes(bf16) == packed
    assert ("packed copy of the linear weights (bf16 on a CPU, at most)", packed) in target_estimate(bf16).items
    float32 = load_recipe(recipe, ["target.dtype=float32"])
    assert packed_weights_bytes(float32) == 0 and not any("packed" in name for name, _ in target_estimate(float32).items)
