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
the same bytes then runs nothing else. DCP never unpickles ``.metadata`` itself: it is
given :class:`CheckedFileSystemReader`, which reads the file once, through
:class:`MetadataUnpickler`, and hands DCP only a :class:`Metadata`; it never reads the
per-rank ``__<rank>.metadata`` files DCP falls back to (with plain ``pickle``) when the
global one cannot be read.
"""

from __future__ import annotations

import io
import pickle  # the allowlisting Unpickler below: find_class refuses all but DCP's metadata
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

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


def _checked(metadata) -> Metadata:
    """``metadata``, unpickled by :class:`MetadataUnpickler`, if it is DCP's :class:`Metadata`.

    The allowlist also admits objects that are not (None, an ``OrderedDict``). torch's own
    ``read_metadata`` fails on some (None), and DCP then falls back to reading the per-rank
    ``__<rank>.metadata`` with plain ``pickle``; so anything else is refused."""
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"it holds {type(metadata).__qualname__}, not DCP's Metadata")
    storage_meta = getattr(metadata, "storage_meta", None)
    if storage_meta is not None and not isinstance(storage_meta, StorageMeta):
        raise UnsafeCheckpointError(
            f"its storage_meta is {type(storage_meta).__qualname__}, not DCP's StorageMeta")
    return metadata


def check_metadata(dcp_dir: Path) -> Metadata:
    """Unpickle ``dcp_dir/.metadata`` with :class:`MetadataUnpickler` and return it; raises
    :class:`UnsafeCheckpointError` (or the unpickler's own error) when it is not DCP's
    :class:`Metadata`."""
    with open(Path(dcp_dir) / METADATA_FILE, "rb") as handle:
        return _checked(MetadataUnpickler(handle).load())


class CheckedFileSystemReader(FileSystemReader):
    """DCP's file-system reader, except that ``.metadata`` is unpickled only by
    :class:`MetadataUnpickler` (:func:`check_metadata`'s checks), once: DCP uses the object
    that was checked, not a second read of a file that may have changed since.

    ``read_metadata`` does what torch's does after unpickling (a ``StorageMeta`` carrying
    this load's ``load_id``). It takes no ``kwargs`` parameter, so DCP (which looks for
    one) never asks it for a rank's ``__<rank>.metadata``, and refuses a ``rank`` anyway:
    only the global ``.metadata`` is read. A refusal is also kept in :attr:`refused`, as
    DCP reports a failed metadata read only as the text of an ``AssertionError``."""

    refused: UnsafeCheckpointError | None = None

    def read_metadata(self, *args: Any, **options: Any) -> Metadata:
        rank = options.get("rank")
        if rank is not None:
            self.refused = UnsafeCheckpointError(
                f"DCP asked for checkpoint file {self._get_metadata_path(rank)}, a rank's own "
                "metadata; draftforge reads only the global .metadata, refusing to unpickle it "
                "(it could run code)")
            raise self.refused
        path = self._get_metadata_path()
        try:
            with self.fs.create_stream(path, "rb") as handle:
                metadata = _checked(MetadataUnpickler(handle).load())
        except UnsafeCheckpointError as exc:
            self.refused = UnsafeCheckpointError(
                f"checkpoint file {path} is not DCP metadata: {exc}; refusing to unpickle it "
                "(it could run code)")
            raise self.refused from None
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


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
