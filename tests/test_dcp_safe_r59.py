"""Security review, round 59: DCP's metadata is unpickled only through draftforge's allowlist.

The allowlist admitted objects that are not DCP's ``Metadata`` (None, an ``OrderedDict``).
torch's ``FileSystemReader.read_metadata`` fails on those, and DCP then falls back to the
per-rank ``__<rank>.metadata``, read with plain ``pickle.load``: a checkpoint folder with
such a ``.metadata`` and a malicious ``__0.metadata`` ran code on resume. draftforge's
check also read the file separately from DCP's load, which read it again. DCP is now given
:class:`CheckedFileSystemReader`, which reads ``.metadata`` once through the allowlist and
never reads a rank's file. In one process, no group (as tests/test_checkpoint_r11.py).
"""

from __future__ import annotations

import os
import pickle
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from test_checkpoint_r11 import _fsdp2_checkpoint
from test_checkpoint_r11 import _load_fsdp2 as _load

from draftforge.errors import InputError
from draftforge.train import checkpoint as ckpt

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Payload:
    """Unpickling this calls ``os.makedirs(marker)``: a harmless stand-in for running code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


# None is the reviewer's case: torch's read_metadata fails on it and DCP unpickled __0.metadata.
# An OrderedDict takes torch's storage_meta attribute, so DCP fails later; both are refused now.
_NOT_METADATA = {"None": (None, "NoneType"), "OrderedDict": (OrderedDict(w=1), "OrderedDict")}


def _plant(folder: Path, stand_in, marker: Path) -> None:
    """The reviewer's folder: a ``.metadata`` the allowlist admits but that is not DCP's
    Metadata, and a rank's ``__0.metadata`` whose unpickling runs the payload."""
    (folder / ".metadata").write_bytes(pickle.dumps(stand_in))
    (folder / "__0.metadata").write_bytes(pickle.dumps(_Payload(marker)))


def _refused_unread(path: Path, marker: Path, type_name: str):
    """Loading ``path`` is refused naming its ``.metadata`` and what it holds, and the planted
    rank's file never ran; the refusal's ``pytest.raises`` info."""
    with pytest.raises(ckpt.CheckpointError) as info:
        _load(path)
    assert not marker.exists(), "DCP unpickled __0.metadata: the payload ran"
    assert str(info.value).startswith(
        f"checkpoint file {path / 'dcp' / '.metadata'} is not DCP metadata: it holds {type_name}, "
        "not DCP's Metadata; refusing to unpickle it (it could run code). Delete the folder")
    return info


@pytest.mark.parametrize("kind", sorted(_NOT_METADATA))
def test_a_metadata_that_is_not_dcps_is_refused_and_the_rank_file_never_read(tmp_path, kind):
    stand_in, type_name = _NOT_METADATA[kind]
    path, _, _ = _fsdp2_checkpoint(tmp_path / "run")
    marker = tmp_path / "PWNED"
    _plant(path / "dcp", stand_in, marker)
    info = _refused_unread(path, marker, type_name)
    assert isinstance(info.value, InputError)
    # the rank's file is live: DCP's own unpickler would run it
    pickle.loads((path / "dcp" / "__0.metadata").read_bytes())
    assert marker.is_dir()


@pytest.mark.parametrize("kind", sorted(_NOT_METADATA))
def test_a_metadata_swapped_after_the_check_is_refused_by_dcps_own_read(tmp_path, monkeypatch, kind):
    """The check and DCP's load read the file apart: one replaced in between (a genuine one
    when checked) is refused by the reader DCP is given, with the same message."""
    stand_in, type_name = _NOT_METADATA[kind]
    path, _, _ = _fsdp2_checkpoint(tmp_path / "run")
    marker = tmp_path / "PWNED"
    checked = ckpt._check_dcp

    def check_then_swap(folder: Path) -> None:
        checked(folder)
        _plant(folder / "dcp", stand_in, marker)

    monkeypatch.setattr(ckpt, "_check_dcp", check_then_swap)
    _refused_unread(path, marker, type_name)


def test_dcp_given_the_checked_reader_never_falls_back_to_a_ranks_metadata(tmp_path):
    """DCP's own load, given the reader: it fails (no plain-pickle fallback), and a rank's
    file asked for directly is refused unread."""
    import torch.distributed.checkpoint as dcp

    from draftforge.train.dcp_safe import (
        CheckedFileSystemReader,
        CheckedLoadPlanner,
        UnsafeCheckpointError,
    )

    folder = tmp_path / "dcp"
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(folder))
    marker = tmp_path / "PWNED"
    _plant(folder, None, marker)
    reader = CheckedFileSystemReader(str(folder))
    with pytest.raises(BaseException, match="global metadata read failed: checkpoint file"):
        dcp.load({"w": torch.zeros(4)}, storage_reader=reader, planner=CheckedLoadPlanner())
    assert "it holds NoneType, not DCP's Metadata" in str(reader.refused)
    with pytest.raises(UnsafeCheckpointError, match=r"__0\.metadata, a rank's own metadata"):
        CheckedFileSystemReader(str(folder)).read_metadata(rank=0)
    assert not marker.exists()


def test_a_storage_meta_that_is_not_dcps_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    from draftforge.train.dcp_safe import UnsafeCheckpointError, check_metadata

    folder = tmp_path / "dcp"
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(folder))
    metadata = check_metadata(folder)
    metadata.storage_meta = OrderedDict()
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match="its storage_meta is OrderedDict, not DCP's StorageMeta"):
        check_metadata(folder)


def test_a_dcp_round_trip_through_the_checked_reader_loads_what_torchs_reader_does(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    from draftforge.train.dcp_safe import CheckedFileSystemReader, CheckedLoadPlanner

    folder = tmp_path / "dcp"
    saved = {"w": torch.randn(5, 3, generator=torch.Generator().manual_seed(1)),
             "b": torch.arange(7, dtype=torch.bfloat16), "opt": {"lr": 0.1, "step": 3}}
    dcp.save(saved, checkpoint_id=str(folder))

    def blank() -> dict:
        return {"w": torch.zeros(5, 3), "b": torch.zeros(7, dtype=torch.bfloat16),
                "opt": {"lr": 0.0, "step": 0}}

    ours, theirs = blank(), blank()
    reader = CheckedFileSystemReader(str(folder))
    dcp.load(ours, checkpoint_id=str(folder), storage_reader=reader, planner=CheckedLoadPlanner())
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(str(folder)))
    for loaded in (ours, theirs):
        assert torch.equal(loaded["w"], saved["w"]) and torch.equal(loaded["b"], saved["b"])
        assert loaded["b"].dtype == torch.bfloat16 and loaded["opt"] == {"lr": 0.1, "step": 3}
    assert reader.refused is None
    metadata = reader.read_metadata()  # what torch's read_metadata sets after unpickling
    assert isinstance(metadata, Metadata) and isinstance(metadata.storage_meta, StorageMeta)
    assert metadata.storage_meta.load_id == reader.load_id


def test_an_fsdp2_resume_still_loads_the_saved_model_and_optimizer(tmp_path):
    path, model, optimizer = _fsdp2_checkpoint(tmp_path / "run")
    loaded_model, loaded_optimizer = _load(path)
    assert torch.equal(loaded_model.weight, model.weight) and torch.equal(loaded_model.bias, model.bias)
    saved_state, loaded_state = optimizer.state_dict()["state"], loaded_optimizer.state_dict()["state"]
    assert saved_state.keys() == loaded_state.keys()
    for index, moments in saved_state.items():
        for name, value in moments.items():
            assert torch.equal(torch.as_tensor(loaded_state[index][name]), torch.as_tensor(value)), name
