"""``dtype: auto``: bfloat16 where this machine multiplies it natively, float32 elsewhere.

On a CPU, bfloat16 matmuls are fast only with hardware support (x86 AMX or
AVX512-BF16, Arm's BF16 extension). Without it PyTorch emulates them: on a 2-core
AVX2-only AMD EPYC a 512x576x1536 bf16 matmul ran at 0.8 GFLOP/s against 57 in
float32, so a bf16 recipe there takes hours instead of minutes. On the machines the
CPU recipes were tuned on, bf16 was about 5x float32. The choice is read from the
CPU's flags, not timed, so every rank of a job on the same machine resolves alike.
``target.dtype`` and ``train.dtype`` resolve ``auto`` when their section is built (a
recipe loaded, a config made in code), so the value a run records is the one it used.
"""

from __future__ import annotations

from pathlib import Path

CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")  # x86 AMX, x86 AVX512, aarch64


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """The CPU flags of ``cpuinfo`` (default: ``/proc/cpuinfo``) that give native bf16
    matmuls; empty where there are none or the file cannot be read (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):  # the first processor's list
            return [flag for flag in CPU_BF16_FLAGS if flag in value.split()]
    return []


def resolve_auto(setting: str, device: str = "auto") -> str:
    """``setting`` with ``auto`` resolved for a process on ``device`` (cpu, cuda or auto =
    CUDA when there is one), the way the recipe sections resolve their ``dtype``."""
    if setting != "auto":
        return setting
    import torch

    return resolve_dtype(setting, cuda=device != "cpu" and torch.cuda.is_available())


def resolve_dtype(setting: str, *, cuda: bool, cpuinfo: str | None = None) -> str:
    """``bfloat16`` or ``float32`` for a dtype setting: explicit values stay; ``auto`` is
    bfloat16 on a CUDA device with bf16 support or a CPU with native bf16, else float32."""
    if setting != "auto":
        return setting
    if cuda:
        import torch

        # without emulation: torch's default also says yes on GPUs older than Ampere, which
        # can hold a bf16 tensor but multiply it only emulated
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return "bfloat16" if native else "float32"
    return "bfloat16" if cpu_bf16_flags(cpuinfo) else "float32"
