"""Load an FSDP2 (torch.distributed.checkpoint) checkpoint without unpickling arbitrary code.

DCP stores its ``.metadata`` with plain ``pickle`` and the non-tensor items of a state
dict (the optimizer's step counts and hyper-parameters) with ``torch.save``, and reads
both back with full unpicklers: a crafted checkpoint folder would run code on resume.
Here every pickle is checked before DCP reads it:

- ``.metadata`` by :class:`MetadataUnpickler`, whose ``find_class`` admits only the
  classes DCP's metadata consists of (its own metadata dataclasses, paths, ``torch.Size``,
  dtypes); anything else is refused before any object is built, and so is setting an
  attribute of an admitted class or function (pickle's BUILD on it, which would change
  it for the whole process);
- each non-tensor item by ``torch.load(weights_only=True)`` (:class:`CheckedLoadPlanner`).

A pickle that these loaders accept only rebuilds those objects, so DCP's own load of
the same bytes then runs nothing else.
"""

from __future__ import annotations

import io
import pickle  # the allowlisting Unpickler below: find_class refuses all but DCP's metadata
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

METADATA_FILE = ".metadata"
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint pickle refers to something DCP's files never hold."""


class MetadataUnpickler(pickle._Unpickler):  # the Python one: its BUILD can be checked
    """Unpickles DCP's ``.metadata`` only: every global it names must be on the allowlist,
    and none gets its attributes set."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        if module == "torch.distributed.checkpoint.metadata" and "." not in name:
            # its classes only: the module also holds os, torch, dataclass, field
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"it refers to {module}.{name}, which DCP metadata never holds")

    def _load_build(self) -> None:
        # BUILD sets the state of the object below it: on a class or function (an admitted
        # global, never an object DCP builds) that is a setattr for the whole process
        target = self.stack[-2] if len(self.stack) > 1 else None
        if callable(target):
            raise UnsafeCheckpointError(
                f"it sets attributes of {getattr(target, '__qualname__', target)!r}, which DCP "
                "metadata never does")
        super().load_build()

    dispatch[pickle.BUILD[0]] = _load_build


def check_metadata(dcp_dir: Path):
    """Unpickle ``dcp_dir/.metadata`` with :class:`MetadataUnpickler` and return it; raises
    :class:`UnsafeCheckpointError` (or the unpickler's own error) when it is not DCP's."""
    with open(Path(dcp_dir) / METADATA_FILE, "rb") as handle:
        return MetadataUnpickler(handle).load()


def short_storage_file(dcp_dir: Path, metadata) -> tuple[Path, str] | None:
    """The first data file that ``metadata`` (from :func:`check_metadata`) needs but that is
    missing or shorter than the items it holds, with what is wrong; None when all are whole.

    DCP itself reports a truncated file only as a ``CheckpointException`` naming ranks, not
    the file; this names it before any rank starts loading."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = str(info.relative_path)
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(needed.items()):
        file = Path(dcp_dir) / name
        if not file.is_file():
            return file, "missing"
        size = file.stat().st_size
        if size < end:
            return file, f"{size} bytes, its items need {end}"
    return None


def failures(exc: BaseException) -> list[BaseException]:
    """``exc`` and, for DCP's ``CheckpointException``, every rank's failure it collects in
    ``failures`` (each an ``(exception, stack)`` pair)."""
    collected = getattr(exc, "failures", None) or {}
    return [exc, *(f[0] if isinstance(f, tuple) else f for f in collected.values())]


def unsafe_failure(exc: BaseException) -> UnsafeCheckpointError | None:
    """The :class:`UnsafeCheckpointError` that is or is inside ``exc`` (:func:`failures`), if
    there is one."""
    return next((error for error in failures(exc) if isinstance(error, UnsafeCheckpointError)), None)


class CheckedLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, loading each non-tensor item only after a weights-only load
    of the same bytes succeeded."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        data = value.getvalue() if hasattr(value, "getvalue") else value.read()
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"item {read_item.dest_index.fqn} is not plain data ({str(exc).splitlines()[0]})"
            ) from None
        super().load_bytes(read_item, io.BytesIO(data))
