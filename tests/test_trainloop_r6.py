"""Round 6 of the trainer loop's review: the DCP metadata check refuses a pickle that reaches
a module or sets attributes of an admitted global."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from draftforge.train.dcp_safe import UnsafeCheckpointError, check_metadata

_METADATA_MODULE = b"torch.distributed.checkpoint.metadata"


def _build_on(module: bytes, name: bytes, attribute: str, value: str) -> bytes:
    """A pickle of GLOBAL module.name, then BUILD with slot state {attribute: value}: what
    pickle does as ``setattr(module.name, attribute, value)``."""
    def text(s: str) -> bytes:
        return b"X" + len(s).to_bytes(4, "little") + s.encode()

    return (b"\x80\x04c" + module + b"\n" + name + b"\n"
            + b"N}(" + text(attribute) + text(value) + b"u\x86b.")


def _write(folder, payload: bytes):
    folder.mkdir()
    (folder / ".metadata").write_bytes(payload)
    return folder


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_genuine_dcp_metadata_still_passes(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    dcp.save({"w": torch.arange(4.0), "opt": {"lr": 0.1, "step": 3}}, checkpoint_id=str(tmp_path / "dcp"))
    written = (tmp_path / "dcp" / ".metadata").read_bytes()
    checked = check_metadata(tmp_path / "dcp")
    assert isinstance(checked, Metadata)  # returned as DCP's own reader reads it
    expected = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    assert checked.state_dict_metadata.keys() == expected.state_dict_metadata.keys() == {"w", "opt.lr", "opt.step"}
    w = checked.state_dict_metadata["w"]
    assert isinstance(w, TensorStorageMetadata) and tuple(w.size) == (4,)
    assert checked.state_dict_metadata == expected.state_dict_metadata
    assert (tmp_path / "dcp" / ".metadata").read_bytes() == written  # read only


def test_metadata_reaching_the_os_module_is_refused_before_it_changes_it(tmp_path):
    """DCP's metadata module imports os and torch: admitting every name in it let a crafted
    .metadata set os.sep (or torch.load, os.environ) in the trainer process while it was
    being checked."""
    payload = _build_on(_METADATA_MODULE, b"os", "sep", "!")
    folder = _write(tmp_path / "dcp", payload)
    original = os.sep
    try:
        with pytest.raises(UnsafeCheckpointError, match="torch.distributed.checkpoint.metadata.os"):
            check_metadata(folder)
        assert os.sep == original
        pickle.loads(payload)  # the unchecked unpickler does change it: the payload is live
        assert os.sep == "!"
    finally:
        os.sep = original


def test_metadata_setting_attributes_of_an_admitted_class_is_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata

    folder = _write(tmp_path / "dcp", _build_on(_METADATA_MODULE, b"Metadata", "planted", "x"))
    try:
        with pytest.raises(UnsafeCheckpointError, match="sets attributes of 'Metadata'"):
            check_metadata(folder)
        assert not hasattr(Metadata, "planted")
    finally:
        if "planted" in vars(Metadata):
            delattr(Metadata, "planted")


class _Crash(RuntimeError):
    pass


def test_a_resumed_run_that_trains_drops_the_earlier_segments_summary(tmp_path):
    """summary.json describes the run as it last ended. A segment that stopped when its data
    ran out at step 4 says so; a resume given more data that trains on and crashes at step 9
    (checkpoint 8) must not leave that summary behind, or ``draftforge demo`` takes step 4
    for the end of training (data_ran_out) and evaluates it instead of resuming from 8."""
    from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

    from draftforge.eval.demo_state import data_ran_out
    from draftforge.train import checkpoint as ckpt
    from draftforge.train.sample import pack
    from draftforge.train.trainer import Trainer

    def trainer(resume: str) -> Trainer:
        return Trainer(model_config=tiny_model_config(),
                       train=train_config(steps=12, checkpoint_interval=4, keep_last=5, resume=resume),
                       embeddings=target_embeddings(), run_dir=tmp_path, recipe_yaml="name: test\n")

    batches = pack(chain_samples(60), 90)
    assert len(batches) >= 9
    first = trainer("never").fit(batches[:4])
    assert first.stopped_reason == "data_exhausted" and first.step == 4
    assert data_ran_out(tmp_path) == ckpt.checkpoint_path(tmp_path, 4)  # the control

    resumed = trainer("auto")
    assert resumed.resume().step == 4

    def crash_at_9(record):
        if record["step"] == 9:
            raise _Crash

    with pytest.raises(_Crash):
        resumed.fit(batches[4:], on_step=crash_at_9)
    assert ckpt.find_resume(tmp_path, "auto") == ckpt.checkpoint_path(tmp_path, 8)
    assert data_ran_out(tmp_path) is None
