"""``dtype: auto``: bfloat16 only where the CPU multiplies it natively (core/precision.py)."""

from __future__ import annotations

import pytest
from splitserve_helpers import ROOT

from draftforge.config import load_recipe
from draftforge.precision import cpu_bf16_flags, resolve_dtype

# first lines of /proc/cpuinfo of three kinds of machine (flags shortened)
AMX = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
AVX2 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx2 fma\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
OLD_ARM = "processor\t: 0\nFeatures\t: fp asimd\n"


def test_native_bf16_is_read_from_the_cpu_flags():
    assert cpu_bf16_flags(AMX) == ["amx_bf16", "avx512_bf16"]
    assert cpu_bf16_flags(AVX2) == []
    assert cpu_bf16_flags(ARM) == ["bf16"]
    assert cpu_bf16_flags(OLD_ARM) == []
    assert cpu_bf16_flags("") == []


@pytest.mark.parametrize(("cpuinfo", "want"), [(AMX, "bfloat16"), (AVX2, "float32"),
                                                (ARM, "bfloat16"), (OLD_ARM, "float32")])  # fmt: skip
def test_auto_follows_the_cpu_and_explicit_values_stay(cpuinfo, want):
    assert resolve_dtype("auto", cuda=False, cpuinfo=cpuinfo) == want
    for explicit in ("bfloat16", "float32"):
        assert resolve_dtype(explicit, cuda=False, cpuinfo=cpuinfo) == explicit


def test_the_cpu_recipes_resolve_auto_for_this_machine(tmp_path):
    want = "bfloat16" if cpu_bf16_flags() else "float32"
    cfg = load_recipe(ROOT / "recipes" / "smollm2-cpu.yaml")
    assert (cfg.target.dtype, cfg.train.dtype) == (want, want)
    # the saved recipe holds the resolved value, so a run records what it ran in
    assert f"  dtype: {want}\n" in cfg.to_yaml() and "dtype: auto" not in cfg.to_yaml()
    # an explicit dtype is kept, auto or not elsewhere
    cfg = load_recipe(ROOT / "recipes" / "smollm2-cpu.yaml", ["train.dtype=bfloat16"])
    assert (cfg.target.dtype, cfg.train.dtype) == (want, "bfloat16")
    assert load_recipe(ROOT / "recipes" / "ling3-flash-dspark.yaml").train.dtype == "bfloat16"


def test_sections_made_in_code_resolve_auto_too():
    from draftforge.splitserve.config import TargetConfig
    from draftforge.train.config import TrainConfig

    want = "bfloat16" if cpu_bf16_flags() else "float32"
    import torch

    cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    assert TargetConfig().dtype == ("bfloat16" if cuda_bf16 else want)  # on CUDA where there is one
    assert TrainConfig(device="cpu").dtype == want  # a CPU trainer: the CPU decides
    assert TrainConfig(device="cpu", dtype="bfloat16").dtype == "bfloat16"


def test_auto_on_a_gpu_that_only_emulates_bf16_is_float32(monkeypatch):
    """torch.cuda.is_bf16_supported() says yes on a pre-Ampere GPU (it can hold a bf16
    tensor); auto must ask whether it multiplies bf16 natively."""
    import torch

    from draftforge.precision import resolve_dtype

    def supported(including_emulation: bool = True) -> bool:  # a T4 (compute capability 7.5)
        return including_emulation

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", supported)
    assert resolve_dtype("auto", cuda=True) == "float32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_dtype("auto", cuda=True) == "bfloat16"  # an A100, an H200
