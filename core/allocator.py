"""Keep glibc's allocator from handing large tensors back to the kernel after every step.

A CPU training step allocates and frees the same vocabulary-sized temporaries
(tens of MB) again and again. With glibc's defaults, part of that memory goes
back to the kernel when it is freed (``munmap``, or a trim of the heap top)
and comes back as fresh pages that fault and are zeroed on first touch: on a
2-core machine one trainer step at the CPU recipe's shapes took 7-12 % longer
on average, with some steps a third slower (``draftforge bench train
recipes/smollm2-cpu.yaml`` run with ``DRAFTFORGE_MALLOC=default`` and
without). :func:`tune_malloc` raises the mmap and trim thresholds once per
process so that freed blocks stay in the heap for reuse.

The cost: up to ``TRIM_THRESHOLD`` of freed memory stays mapped to the
process. Set ``DRAFTFORGE_MALLOC=default`` to keep glibc's behaviour. Other C
libraries (musl, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

from draftforge.errors import InputError

# mallopt parameters (glibc <malloc.h>)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit: blocks up to 32 MiB come from the heap
TRIM_THRESHOLD = 1 << 30  # keep up to 1 GiB of free heap top instead of returning it at once
TOP_PAD = 64 << 20  # grow the heap in 64 MiB steps
ENV = "DRAFTFORGE_MALLOC"

_applied: bool | None = None


def tune_malloc() -> bool:
    """Apply the settings above once per process; True when they are in effect.

    False (and nothing changed) when ``DRAFTFORGE_MALLOC=default``, off Linux,
    or when the C library has no ``mallopt`` that accepts them.
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    setting = os.environ.get(ENV, "tuned").strip().lower()
    if setting not in ("tuned", "default"):
        raise InputError(f"{ENV}={os.environ[ENV]!r}: expected 'tuned' (the default) or 'default'")
    if setting == "default" or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _applied = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (_M_TOP_PAD, TOP_PAD),
        )
    )
    return _applied
