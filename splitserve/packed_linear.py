"""Pre-packed bf16 weights for a CPU target's linear layers, used where they give F.linear's bits.

Decoding on a CPU multiplies a few rows (one per sequence still generating) by every
weight of the target. For bf16 weights oneDNN first reorders each weight into its blocked
layout, on every call: for one of SmolLM2-135M's weights (576 x 1536) at 16 rows, one
thread, a matmul took about 1.4 times as long as with the weight reordered once at load
(``torch.ops.mkldnn._reorder_linear_weight``, then ``_linear_pointwise``, the ops
inductor's CPU freezing pass uses). :func:`pack_linear_weights` reorders every
``nn.Linear`` of a model once and routes its no-grad forward through the packed copy.

The packed path is taken only where it reproduces ``F.linear`` bit for bit: for each
weight shape (and bias), the first module's weight is multiplied both ways at several
row counts, and a shape whose results differ in any bit keeps ``F.linear``. So
regenerated answers, features and the evaluator's verification are the same as
without packing (the tests compare generated tokens and features). A module whose weight
was changed in place or replaced, or a call with gradients enabled, on another device
or in another dtype, also takes ``F.linear``. An edit through ``weight.data`` (``.data.copy_``,
an adapter merged as ``weight.data += delta``) is not seen: it moves no version counter, and
the packed copy would keep the old weight; edit weights before :func:`pack_linear_weights`,
or with ``DRAFTFORGE_PACKED_LINEAR=off`` (nothing in draftforge edits a target's weights).

The cost: a second copy of the linear weights in memory (SmolLM2-135M: 269 MB in bf16).
Nothing is packed when that copy would take more than a quarter of the memory the
kernel reports available (``MemAvailable``), so a large target on a small machine keeps
``F.linear``. ``DRAFTFORGE_PACKED_LINEAR=off`` keeps every linear on ``F.linear``.
"""

from __future__ import annotations

import os
import types

import torch
import torch.nn.functional as F
from torch import nn

from draftforge.errors import InputError

ENV = "DRAFTFORGE_PACKED_LINEAR"
#: the row counts the bit-for-bit check multiplies: from one sequence decoding through partial
#: and full decoding batches and a block of 8's verification width (9) to a short prefill
CHECK_ROWS = (1, 2, 3, 5, 8, 9, 16, 17, 33, 100)


def packing_enabled() -> bool:
    """``DRAFTFORGE_PACKED_LINEAR``: True for ``on`` (the default), False for ``off``; any other
    value is an InputError (commands check it at start, before a target loads)."""
    setting = os.environ.get(ENV, "on").strip().lower()
    if setting not in ("on", "off"):
        raise InputError(f"{ENV}={os.environ[ENV]!r}: expected 'on' (the default) or 'off'")
    return setting == "on"


def _ops_available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and mkldnn is not None
            and hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise"))


def _available_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo; None where there is none (not Linux)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _copy_fits(nbytes: int) -> bool:
    """Whether a packed copy of ``nbytes`` takes at most a quarter of ``MemAvailable`` (True
    where that is unknown)."""
    available = _available_bytes()
    return available is None or 4 * nbytes <= available


def _packed(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)


def packed_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 CPU ``weight`` ``[out, in]`` reordered once for :func:`packed_product`; None where
    packing is off, the ops are missing, the weight is not bf16 on a CPU, or the copy would take
    over a quarter of the memory the kernel reports available. Whether the
    product gives ``x @ weight.T``'s bits is the caller's to check (at its row counts)."""
    if (weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not packing_enabled()
            or not _ops_available()):
        return None
    return _packed(weight) if _copy_fits(weight.nbytes) else None


def packed_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` through :func:`packed_copy`'s reordered weight (x: bf16, contiguous)."""
    return _packed_linear(x, packed, None)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.no_grad()
def _reproduces_linear(module: nn.Linear, packed: torch.Tensor) -> bool:
    """Whether the packed weight gives ``F.linear``'s exact result at every ``CHECK_ROWS``."""
    generator = torch.Generator().manual_seed(0)
    bias = None if module.bias is None else module.bias.detach()
    for rows in CHECK_ROWS:
        x = torch.randn(rows, module.in_features, generator=generator).to(module.weight.dtype)
        try:
            got = _packed_linear(x, packed, bias)
        except RuntimeError:
            return False
        if not torch.equal(got, F.linear(x, module.weight.detach(), bias)):
            return False
    return True


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if (torch.is_grad_enabled() or weight is not self._draftforge_packed_source
            or weight._version != self._draftforge_packed_version
            or weight.data_ptr() != self._draftforge_packed_pointer
            or weight.dtype != torch.bfloat16 or weight.device.type != "cpu"
            or x.dtype != torch.bfloat16 or x.device.type != "cpu" or not x.is_contiguous()):
        return F.linear(x, weight, self.bias)
    return _packed_linear(x, self._draftforge_packed, self.bias)


def pack_linear_weights(model: nn.Module) -> int:
    """Pack the bf16 CPU weights of ``model``'s ``nn.Linear`` modules (see the module's
    docstring); returns how many were packed, 0 where packing is off, unavailable or never
    bit-identical here. Idempotent: a module packed before is left as it is."""
    if not packing_enabled() or not _ops_available():
        return 0
    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.dtype == torch.bfloat16
               and m.weight.device.type == "cpu" and "_draftforge_packed" not in m.__dict__]
    if not _copy_fits(sum(m.weight.nbytes for m in linears)):
        return 0
    verdicts: dict[tuple, bool] = {}
    count = 0
    for module in linears:
        weight = module.weight
        key = (tuple(weight.shape), module.bias is not None)
        if verdicts.get(key) is False:  # a shape found not bit-identical: not packed again
            continue
        packed = _packed(weight)
        if key not in verdicts:
            verdicts[key] = _reproduces_linear(module, packed)
        if not verdicts[key]:
            continue
        module._draftforge_packed = packed
        # kept out of the module's parameters (assigning a Parameter registers it: state_dict
        # would gain a key per packed linear, and a strict load of the model's own would fail)
        module.__dict__["_draftforge_packed_source"] = weight
        module._draftforge_packed_version = weight._version
        module._draftforge_packed_pointer = weight.data_ptr()
        module.forward = types.MethodType(_forward, module)
        count += 1
    return count
