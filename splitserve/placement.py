"""Where the evaluated target runs: one device, or spread over several GPUs in layer order.

``draftforge eval`` drives a transformers model itself (the verifier steps its KV
cache), so a target too large for one GPU, such as Ling-3.0-flash, is split
by layers over the GPUs the recipe gives the target group: transformers'
``device_map="sequential"`` fills them in order (as much as fits on the first,
then the next), each layer's activations move to the next GPU as it runs, and
the draft runs on the first GPU, beside the embedding. A target that fits on
the first GPU stays there whole. This is pipeline placement for one request at
a time, not tensor parallelism: it makes the evaluation possible, not fast.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from draftforge.errors import InputError

if TYPE_CHECKING:
    from draftforge.splitserve.config import TargetConfig

# share of each GPU's free memory the target's weights may take: the rest holds
# the KV cache, the activations of a verification forward and CUDA's own workspace
WEIGHT_SHARE = 0.9
DRAFT_HEADROOM_BYTES = 1 << 30  # beside the draft's weights on the first GPU: its activations


def recipe_target_gpus(split) -> list[int]:
    """The GPUs of the recipe's first target group (its first tensor-parallel group's ranks,
    one target), which ``draftforge eval --device auto`` uses: their ``split.target_devices``
    entries; without them, their node-local GPUs (LOCAL_RANK), where a training puts them."""
    from draftforge.splitserve.roles import tensor_parallel_groups

    first = tensor_parallel_groups(split)[0]
    if split.target_devices is not None:
        return [split.target_devices[split.target_ranks.index(rank)] for rank in first]
    per_node = split.world_size // split.num_nodes
    return [rank % per_node for rank in first]


def resolve_devices(choice: str, target_gpus: Sequence[int] | None = None, *,
                    cuda_available: bool | None = None) -> list[str]:
    """The devices ``draftforge eval --device`` names, lowest GPU first (where accelerate puts the
    target's first layers and the evaluator the draft).

    ``auto``: every GPU of the recipe's target group (:func:`recipe_target_gpus`; GPU 0
    without a recipe) when CUDA is visible, else ``cpu``. A comma-separated list of CUDA
    devices (``cuda:0,cuda:1``) names them; one device is checked as
    :func:`~draftforge.splitserve.target.resolve_device` checks it. Raises
    :class:`InputError` for a repeated device, a mix of CPU and GPUs, or a GPU
    that is not visible.
    """
    from draftforge.splitserve.target import resolve_device

    if choice == "auto":
        if not (torch.cuda.is_available() if cuda_available is None else cuda_available):
            return ["cpu"]
        gpus = list(target_gpus or [0])
        visible = torch.cuda.device_count() if cuda_available is None else None
        absent = [gpu for gpu in gpus if visible is not None and gpu >= visible]
        if absent:  # named by the recipe, not by --device: say so
            raise InputError(
                f"--device auto: the recipe's first target group runs on GPU(s) {gpus} "
                f"(split.target_devices, else its ranks' LOCAL_RANK), but {visible} GPU(s) are "
                f"visible here, so not {absent}; give the GPUs with --device cuda:0,cuda:1,..."
            )
        names = [f"cuda:{i}" for i in gpus]
    else:
        names = [part.strip() for part in choice.split(",")]
        if any(not name for name in names):
            raise InputError(f"--device {choice!r}: an empty entry in the list; give e.g. cuda:0,cuda:1")
    devices = [resolve_device(name, None, cuda_available=cuda_available) for name in names]
    devices = [f"cuda:{torch.device(d).index or 0}" if d.startswith("cuda") else d for d in devices]
    if len(devices) > 1:
        if any(not d.startswith("cuda") for d in devices):
            raise InputError(f"--device {choice!r}: a target is spread over GPUs only; give cpu alone "
                             "or a list of cuda:N")
        repeated = sorted({d for d in devices if devices.count(d) > 1})
        if repeated:
            raise InputError(f"--device {choice!r}: {', '.join(repeated)} named twice")
        # accelerate fills GPUs in index order whatever order they are named in: the first
        # (the draft's, with the target's embedding and inputs) is the lowest
        devices.sort(key=lambda d: torch.device(d).index or 0)
    return devices


@dataclass(frozen=True)
class Spread:
    """A target to be split by layers over ``devices`` (GPUs), each GPU index holding at most
    ``max_memory[index]`` bytes of weights, filled in index order (accelerate's)."""

    devices: tuple[str, ...]
    max_memory: dict[int | str, int]


def spread_placement(devices: Sequence[str], *, reserve_first_bytes: int,
                     free_bytes: Callable[[int], int] | None = None) -> Spread:
    """How the target is spread over ``devices`` (GPUs) in layer order.

    Each GPU may take :data:`WEIGHT_SHARE` of its free memory (``free_bytes(index)``;
    ``torch.cuda.mem_get_info`` by default); the first also keeps
    ``reserve_first_bytes`` for the draft.
    """
    indices = [torch.device(d).index or 0 for d in devices]
    if free_bytes is None:
        free_bytes = lambda index: torch.cuda.mem_get_info(index)[0]  # noqa: E731
    max_memory: dict[int | str, int] = {index: int(free_bytes(index) * WEIGHT_SHARE) for index in indices}
    first = indices[0]
    if max_memory[first] <= reserve_first_bytes:
        raise InputError(
            f"{devices[0]} has {max_memory[first] / 2**30:.1f} GiB for weights and the draft needs "
            f"{reserve_first_bytes / 2**30:.1f} GiB of it; free that GPU or name another first "
            "with --device"
        )
    max_memory[first] -= reserve_first_bytes
    return Spread(devices=tuple(devices), max_memory=max_memory)


def plan_device_map(folder: str | Path, spread: Spread, cfg: TargetConfig) -> dict[str, int | str]:
    """accelerate's layer-by-layer map of the model in ``folder`` within ``spread``, worked out on
    an empty (meta) model before any weight is read: ``from_pretrained(device_map=...)`` takes it
    as it is. Raises :class:`InputError` when part of the model would fall outside
    ``spread.devices`` (onto the CPU or the disk), so a target that does not fit is refused
    before minutes of loading. ``cfg``: the recipe's target section (dtype, trust_remote_code)."""
    from accelerate import infer_auto_device_map
    from transformers import AutoConfig, AutoModelForCausalLM

    from draftforge.splitserve.hf_backend import DTYPES

    dtype = DTYPES[cfg.dtype]
    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=cfg.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
    device_map = infer_auto_device_map(
        model,
        max_memory=dict(spread.max_memory),
        no_split_module_classes=list(model._no_split_modules or []),
        dtype=dtype,
    )
    check_placement(device_map, spread.devices)
    return device_map


def check_placement(device_map: Mapping[str, object], devices: Sequence[str]) -> None:
    """Raise :class:`InputError` when ``device_map`` (module name -> accelerate's device) puts
    part of the model outside ``devices`` (on the CPU or the disk: it did not fit on them)."""
    allowed = {str(torch.device(d)) for d in devices}
    outside = {name: where for name, where in device_map.items() if _device_name(where) not in allowed}
    if outside:
        where = sorted({_device_name(w) for w in outside.values()})
        first = ", ".join(list(outside)[:3]) + (", ..." if len(outside) > 3 else "")
        raise InputError(
            f"the target does not fit on {', '.join(devices)}: {len(outside)} of its modules "
            f"({first}) would run from {', '.join(where)}; give more GPUs with --device "
            "cuda:0,cuda:1,... or free memory on them"
        )


def describe_placement(device_map: Mapping[str, object]) -> str:
    """Which decoder layers run where, e.g. ``layers 0-20 on cuda:0, 21-41 on cuda:1``."""
    runs: list[tuple[str, int, int]] = []  # (device, first layer, last layer)
    for name, where in device_map.items():
        parts = name.split(".")
        if "layers" not in parts[:-1]:
            continue
        index = int(parts[parts.index("layers") + 1])
        device = _device_name(where)
        if runs and runs[-1][0] == device and index - runs[-1][2] in (0, 1):
            runs[-1] = (device, runs[-1][1], index)  # the next layer, or a part of the same one
        else:
            runs.append((device, index, index))
    if not runs:
        devices = sorted({_device_name(w) for w in device_map.values()})
        return "whole on " + ", ".join(devices) if devices else "whole"
    return "layers " + ", ".join(
        f"{a}-{b} on {d}" if a != b else f"{a} on {d}" for d, a, b in runs
    )


def _device_name(where: object) -> str:
    """accelerate's device-map values (a GPU index, ``'cpu'``, ``'disk'``, ``'cuda:1'``) as names."""
    if isinstance(where, int):
        return f"cuda:{where}"
    if where == "disk":
        return "disk"
    return str(torch.device(where))
