"""Load an FSDP2 (torch.distributed.checkpoint) checkpoint without unpickling arbitrary code.

DCP stores its ``.metadata`` with plain ``pickle`` and the non-tensor items of a state
dict (the optimizer's step counts and hyper-parameters) with ``torch.save``, and reads
both back with full unpicklers: a crafted checkpoint folder would run code on resume.
Here every pickle is checked before DCP reads it:

- ``.metadata`` by :class:`MetadataUnpickler`, whose ``find_class`` admits only the
  classes DCP's metadata consists of (its own metadata dataclasses, paths, ``torch.Size``,
  dtypes); anything else is refused before any object is built;
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


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` only: every global it names must be on the allowlist."""

    def find_class(self, module: str, name: str):
        if module == "torch.distributed.checkpoint.metadata" and "." not in name:
            return super().find_class(module, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"it refers to {module}.{name}, which DCP metadata never holds")


def check_metadata(dcp_dir: Path) -> None:
    """Unpickle ``dcp_dir/.metadata`` with :class:`MetadataUnpickler`; raises
    :class:`UnsafeCheckpointError` (or the unpickler's own error) when it is not DCP's."""
    with open(Path(dcp_dir) / METADATA_FILE, "rb") as handle:
        MetadataUnpickler(handle).load()


def unsafe_failure(exc: BaseException) -> UnsafeCheckpointError | None:
    """The :class:`UnsafeCheckpointError` inside DCP's ``CheckpointException`` (which
    collects every rank's failure in ``failures``), if there is one."""
    if isinstance(exc, UnsafeCheckpointError):
        return exc
    for failure in getattr(exc, "failures", {}).values():
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, UnsafeCheckpointError):
            return error
    return None


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
