"""Security: no loader unpickles a file handed to draftforge; remote code and ports stay closed by default.

A malicious pickle-based weight file (its unpickling would create a marker
folder: a harmless stand-in for running code) is offered to every loader; each
refuses it and the marker never appears. A control load with plain
``torch.load(weights_only=False)`` proves the file really does run its payload.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.errors import InputError
from draftforge.train import checkpoint as ckpt
from draftforge.train.export import load_training_checkpoint
from draftforge.train.hf_load import load_exported_draft
from draftforge.train.sample import pack
from draftforge.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("core", "train", "data", "splitserve", "eval")


class _Payload:
    """Unpickling this calls ``os.makedirs(marker)``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def _malicious(path: Path, marker: Path, *, zip_format: bool = True) -> Path:
    payload = {"weight": torch.zeros(2), "evil": _Payload(marker)}
    if zip_format:
        torch.save(payload, path)  # what a .pt / pytorch_model.bin looks like
    else:
        path.write_bytes(pickle.dumps(payload))
    return path


def test_the_payload_is_real(tmp_path):
    """Control: an unsafe load of the same kind of file does run the payload."""
    marker = tmp_path / "control-marker"
    evil = _malicious(tmp_path / "control.pt", marker)
    torch.load(evil, weights_only=False)
    assert marker.is_dir()


@pytest.fixture()
def marker(tmp_path):
    path = tmp_path / "PWNED"
    yield path
    assert not path.exists(), "a loader unpickled the malicious file"


def _draft_config_json(folder: Path) -> None:
    (folder / "draft_config.json").write_text(json.dumps(asdict(tiny_model_config())))


@pytest.mark.parametrize("name", ["model.safetensors", "evil.pt"])
def test_training_checkpoint_loader_refuses_a_pickle(tmp_path, marker, name):
    folder = tmp_path / "step_00000004"
    folder.mkdir()
    _draft_config_json(folder)
    evil = _malicious(folder / name, marker)
    source = evil if name.endswith(".pt") else folder
    with pytest.raises(InputError) as info:
        load_training_checkpoint(source)
    if name.endswith(".pt"):  # refused by its name, before it is opened
        assert str(info.value).startswith(f"{evil} is a file but no model.safetensors (draftforge reads "
                                          "a draft's weights from safetensors only)")
    else:
        assert f"{evil}: not a readable safetensors file" in str(info.value)
        assert "looks like a pickle" in str(info.value) and "safetensors only" in str(info.value)


def test_export_loader_refuses_pickled_weights(tmp_path, marker):
    folder = tmp_path / "export"
    folder.mkdir()
    from draftforge.train.export import serving_config

    config = serving_config(tiny_model_config(), arch="Qwen3DSparkModel", dtype=torch.float32)
    (folder / "config.json").write_text(json.dumps(config))
    _malicious(folder / "pytorch_model.bin", marker, zip_format=False)
    with pytest.raises(InputError, match=r"found pickled weights \['pytorch_model.bin'\]: draftforge loads safetensors only"):
        load_exported_draft(folder, embed_tokens=torch.zeros(64, 32), lm_head=torch.zeros(64, 32))


def test_resume_refuses_a_pickle_in_place_of_the_weights(tmp_path, marker):
    trainer = Trainer(model_config=tiny_model_config(num_hidden_layers=1),
                      train=train_config(str(tmp_path), steps=4, checkpoint_interval=4),
                      embeddings=target_embeddings(), run_dir=tmp_path)
    trainer.fit(pack(chain_samples(16), 90))
    newest = ckpt.find_resume(tmp_path, "auto")
    _malicious(newest / "model.safetensors", marker)
    again = Trainer(model_config=tiny_model_config(num_hidden_layers=1),
                    train=train_config(str(tmp_path), resume="auto"),
                    embeddings=target_embeddings(), run_dir=tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="model.safetensors is corrupt or truncated"):
        again.resume()


def test_deepspeed_checkpoint_engine_loads_weights_only(tmp_path, marker):
    """DeepSpeed's own checkpoint files are torch pickles: ours loads them with weights_only=True."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from draftforge.train.distributed import _weights_only_checkpoint_engine

    engine = _weights_only_checkpoint_engine(TorchCheckpointEngine())
    evil = _malicious(tmp_path / "mp_rank_00_model_states.pt", marker)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        engine.load(str(evil))
    # the same engine still loads an honest tensor file
    honest = tmp_path / "honest.pt"
    torch.save({"w": torch.ones(3)}, honest)
    assert torch.equal(engine.load(str(honest))["w"], torch.ones(3))


def test_target_loader_refuses_pickle_only_weights(tmp_path, marker):
    """The target backend (tests/test_target_capture.py::test_bin_only_folder_refused with an empty
    file) also refuses a real malicious pytorch_model.bin without opening it."""
    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.target import build_target

    folder = tmp_path / "target"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4,
                                                    "hidden_size": 64, "vocab_size": 100}))
    _malicious(folder / "pytorch_model.bin", marker)
    with pytest.raises(ValueError, match="safetensors only"):
        build_target(TargetConfig(model=str(folder)), [0])


def _source_lines():
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                yield path.relative_to(ROOT), number, line


def test_no_unsafe_deserialisation_in_the_source():
    """Every torch.load passes weights_only=True; nothing imports pickle or calls an unpickler,
    except train/dcp_safe.py, whose Unpickler admits DCP's metadata classes only (below)."""
    allowlisting = Path("train/dcp_safe.py")
    assert "def find_class(self, module: str, name: str):" in (ROOT / allowlisting).read_text()
    unsafe = []
    for path, number, line in _source_lines():
        code = line.split("#", 1)[0]
        if "torch.load(" in code and "weights_only=True" not in code:
            unsafe.append(f"{path}:{number}: {line.strip()}")
        if path != allowlisting and re.search(r"\b(import pickle|pickle\.loads?\(|cPickle|dill|joblib\.load)", code):
            unsafe.append(f"{path}:{number}: {line.strip()}")
        if path == allowlisting and re.search(r"pickle\.loads?\(", code):
            unsafe.append(f"{path}:{number}: {line.strip()}")
    assert not unsafe, "unsafe loaders:\n" + "\n".join(unsafe)


def _dcp_checkpoint(folder: Path, extra=None) -> dict:
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(4.0), "opt": {"lr": 0.1, "step": 3}, **(extra or {})}
    dcp.save(state, checkpoint_id=str(folder))
    return state


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsdp2_checkpoint_metadata_is_unpickled_only_when_it_is_dcps(tmp_path, marker):
    """DCP reads .metadata with plain pickle: draftforge checks it first, with an unpickler
    that admits only DCP's metadata classes."""
    from draftforge.train.dcp_safe import UnsafeCheckpointError, check_metadata

    _dcp_checkpoint(tmp_path / "dcp")
    check_metadata(tmp_path / "dcp")  # a genuine one passes
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(UnsafeCheckpointError, match="refers to os.makedirs, which DCP metadata never holds"):
        check_metadata(tmp_path / "dcp")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsdp2_checkpoint_items_load_only_as_plain_data(tmp_path, marker):
    """DCP torch.loads non-tensor items with weights_only=False: draftforge's planner loads
    each weights-only first. The control shows DCP's own planner runs the payload."""
    import torch.distributed.checkpoint as dcp

    from draftforge.train.dcp_safe import CheckedLoadPlanner, unsafe_failure

    _dcp_checkpoint(tmp_path / "good")
    target = {"w": torch.zeros(4), "opt": {"lr": 0.0, "step": 0}}
    dcp.load(target, checkpoint_id=str(tmp_path / "good"), planner=CheckedLoadPlanner())
    assert target["opt"] == {"lr": 0.1, "step": 3} and torch.equal(target["w"], torch.arange(4.0))

    control = tmp_path / "control-marker"
    _dcp_checkpoint(tmp_path / "control", {"evil": _Payload(control)})
    dcp.load({"w": torch.zeros(4), "opt": {"lr": 0.0, "step": 0}, "evil": None},
             checkpoint_id=str(tmp_path / "control"))
    assert control.is_dir()

    _dcp_checkpoint(tmp_path / "bad", {"evil": _Payload(marker)})
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
        dcp.load({"w": torch.zeros(4), "opt": {"lr": 0.0, "step": 0}, "evil": None},
                 checkpoint_id=str(tmp_path / "bad"), planner=CheckedLoadPlanner())
    assert "item evil is not plain data" in str(unsafe_failure(info.value))


def test_trust_remote_code_is_off_unless_the_recipe_sets_it():
    from draftforge.splitserve.config import TargetConfig

    assert TargetConfig().trust_remote_code is False
    literal = [f"{p}:{n}" for p, n, line in _source_lines() if re.search(r"trust_remote_code\s*=\s*True", line)]
    assert not literal, literal
    passed = [f"{p}:{n}" for p, n, line in _source_lines() if "trust_remote_code=" in line]
    assert passed and all("cfg.trust_remote_code" in line for p, n, line in _source_lines()
                          if "trust_remote_code=" in line), passed


def test_a_bracketed_ipv6_master_addr_is_bound_without_brackets(tmp_path, capsys):
    """--master-addr [::1] is loopback; the store binds to ::1 (a raw gaierror before)."""
    import socket

    from draftforge.splitserve.launch import main
    from draftforge.splitserve.supervisor import host_store

    assert main([str(ROOT / "recipes" / "tiny-debug.yaml"), "--master-addr", "[::1]", "--dry-run"]) == 0
    assert "rendezvous store hosted by draftforge train on ::1 (loopback only)" in capsys.readouterr().out
    if socket.has_ipv6:
        try:
            store, port = host_store("::1")
        except OSError as exc:  # a machine without IPv6 loopback configured
            pytest.skip(f"no IPv6 loopback here: {exc}")
        assert port > 0
        del store


def test_launcher_binds_rendezvous_to_loopback_by_default():
    from draftforge.splitserve.launch import launch_env
    from draftforge.splitserve.multinode import torchrun_command

    command = torchrun_command("r.yaml", ["train.steps=3"], 2)
    assert "--local-addr=127.0.0.1" in command  # the MASTER_ADDR every rank is given
    env = launch_env()
    assert env["MASTER_ADDR"] == "127.0.0.1"
    if os.environ.get("GLOO_SOCKET_IFNAME") is None and os.sys.platform.startswith("linux"):
        assert env["GLOO_SOCKET_IFNAME"] == "lo"  # gloo's data sockets on loopback
    if os.environ.get("NCCL_SOCKET_IFNAME") is None and os.sys.platform.startswith("linux"):
        assert env["NCCL_SOCKET_IFNAME"] == "lo"  # and NCCL's bootstrap socket
    opened = launch_env("10.0.0.5")
    assert "--local-addr=10.0.0.5" in torchrun_command("r.yaml", [], 2, master_addr="10.0.0.5")
    assert opened.get("GLOO_SOCKET_IFNAME") == os.environ.get("GLOO_SOCKET_IFNAME")
    assert opened.get("NCCL_SOCKET_IFNAME") == os.environ.get("NCCL_SOCKET_IFNAME")


def test_an_interface_from_the_environment_is_kept_but_said(monkeypatch, capsys):
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME left exported (the dry run's multi-node note asks
    for them) put a one-node job's sockets on that interface: the user's choice, now said."""
    from draftforge.splitserve.launch import launch_env

    if not os.sys.platform.startswith("linux"):
        pytest.skip("the interfaces are set on Linux only")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    env = launch_env()
    assert env["GLOO_SOCKET_IFNAME"] == "eth0" and env["NCCL_SOCKET_IFNAME"] == "lo"
    err = capsys.readouterr().err
    assert "GLOO_SOCKET_IFNAME=eth0 from the environment" in err and "not on loopback only" in err
    assert "NCCL_SOCKET_IFNAME" not in err
