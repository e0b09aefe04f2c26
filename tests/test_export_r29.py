"""Export and load-back review, round 29: a killed export's leftovers, SIGTERM, nested wrapper
prefixes, tensors of a dtype no export has."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from dspark_helpers import tiny_draft
from safetensors.torch import load_file, save_file

from draftforge.errors import InputError
from draftforge.train import export as export_mod
from draftforge.train.export import export_draft, load_training_checkpoint
from draftforge.train.hf_load import load_exported_draft


def _quiet(_line):
    pass


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _write_checkpoint(folder: Path, model, rename=lambda name: name) -> None:
    folder.mkdir(parents=True)
    save_file({rename(k): v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "draft_config.json").write_text(json.dumps(asdict(model.config)))


def _kill_between_renames(out: Path) -> Path:
    """What files.replace_dir leaves when the process dies between its two renames: the earlier
    export moved aside into .NAME.old-*/NAME and nothing at NAME (plus a killed staging folder)."""
    retired = out.parent / f".{out.name}.old-killed00"
    retired.mkdir()
    os.replace(out, retired / out.name)
    staging = out.parent / f".{out.name}.tmp-killed00"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"partial")
    return retired / out.name


def test_an_export_after_one_killed_between_its_renames_keeps_the_earlier_export_if_it_fails(
    tmp_path, monkeypatch
):
    out = tmp_path / "export"
    export_draft(tiny_draft(seed=1), out, progress=_quiet)
    before = _files(out)
    _kill_between_renames(out)
    assert not out.exists()

    def broken(state, folder, *, max_shard_size_mb):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_mod, "write_safetensors", broken)
    with pytest.raises(OSError):
        export_draft(tiny_draft(seed=2), out, progress=_quiet)
    # the earlier export is back at its place, whole, and nothing else is left beside it
    assert _files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_an_export_after_a_killed_one_leaves_nothing_but_itself(tmp_path):
    out = tmp_path / "export"
    export_draft(tiny_draft(seed=1), out, progress=_quiet)
    _kill_between_renames(out)
    lines: list[str] = []
    model = tiny_draft(seed=2)
    export_draft(model, out, progress=lines.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no .export.tmp-* / .old-* / .lock
    assert torch.equal(load_file(str(out / "model.safetensors"))["fc.weight"], model.fc.weight)
    assert any("partial folder" in line for line in lines)


def test_an_export_while_another_writes_the_same_folder_is_refused(tmp_path):
    from draftforge.files import exclusive_lock

    out = tmp_path / "export"
    with exclusive_lock(tmp_path / ".export.lock"):
        with pytest.raises(InputError, match="another draftforge export"):
            export_draft(tiny_draft(), out, progress=_quiet)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


_SLOW_EXPORT = textwrap.dedent(
    """
    import sys, time
    from draftforge.train import export as export_mod

    def slow(state, folder, *, max_shard_size_mb):
        (folder / "model.safetensors").write_bytes(b"partial")
        time.sleep(120)

    export_mod.write_safetensors = slow
    from draftforge.train.export_cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def test_sigterm_during_an_export_leaves_no_partial_folder_and_keeps_the_older_export(tmp_path):
    model = tiny_draft(seed=3)
    _write_checkpoint(tmp_path / "ckpt", model)
    out = tmp_path / "new" / "deeper" / "export"
    export_draft(tiny_draft(seed=1), tmp_path / "old", progress=_quiet)
    tests_dir = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))}
    for dest in (out, tmp_path / "old"):
        before = _files(dest) if dest.exists() else None
        proc = subprocess.Popen([sys.executable, "-c", _SLOW_EXPORT, str(tmp_path / "ckpt"), "--out", str(dest)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not list(dest.parent.glob(f".{dest.name}.tmp-*/model.safetensors")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the export never started writing"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert not list(dest.parent.glob(f".{dest.name}.*")), sorted(p.name for p in dest.parent.iterdir())
        if before is None:
            assert not (tmp_path / "new").exists()  # the folders it made above --out are gone too
        else:
            assert _files(dest) == before
        assert "stopped on SIGTERM" in err


@pytest.mark.parametrize("prefix", ["module._orig_mod.", "_orig_mod.module.", "module.", "_orig_mod."])
def test_a_checkpoint_of_a_wrapped_draft_exports_whatever_order_the_wrappers_were_nested(tmp_path, prefix):
    """DDP(torch.compile(m)).state_dict() names module._orig_mod.fc.weight."""
    model = tiny_draft(seed=5)
    _write_checkpoint(tmp_path / "ckpt", model, rename=lambda name: prefix + name)
    cfg, state = load_training_checkpoint(tmp_path / "ckpt")
    assert cfg == model.config
    assert set(state) == set(model.state_dict())
    assert torch.equal(state["fc.weight"], model.fc.weight)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float64])
def test_a_tensor_of_a_dtype_no_export_has_is_refused_naming_its_file_and_key(tmp_path, dtype, sharded):
    model = tiny_draft()
    out = export_draft(model, tmp_path / "export", max_shard_size_mb=0.001 if sharded else 4096, progress=_quiet)
    if sharded:
        weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        file = out / weight_map["norm.weight"]
    else:
        file = out / "model.safetensors"
    tensors = load_file(str(file))
    tensors["norm.weight"] = tensors["norm.weight"].to(dtype)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(InputError) as err:
        load_exported_draft(out, embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight)
    assert f"{file}: norm.weight is {dtype}" in str(err.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_dtypes_exports_have_still_load_bit_identically(tmp_path, dtype):
    model = tiny_draft(dtype=dtype)
    out = export_draft(model, tmp_path / "export", max_shard_size_mb=0.001, progress=_quiet)
    loaded = load_exported_draft(out, embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight)
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(theirs[k].dtype == dtype and torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "sub/model.safetensors", "/abs/x.safetensors", ".."])
def test_an_index_naming_a_shard_outside_its_folder_is_refused(tmp_path, shard):
    """An index whose weight_map names a path, not a file beside it, read a safetensors file
    from anywhere on the disk (``../``): refused, naming the index and the entry."""
    from draftforge.train.hf_load import index_weight_map

    folder = tmp_path / "export"
    (folder / "sub").mkdir(parents=True)
    for place in (tmp_path / "outside.safetensors", folder / "sub" / "model.safetensors"):
        save_file({"w": torch.zeros(1)}, str(place))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"w": shard}}))
    with pytest.raises(InputError, match=rf"names shard {re.escape(repr(shard))}, which is not a file name"):
        index_weight_map(index, advice="export the draft again")
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"w": "model.safetensors"}}))
    save_file({"w": torch.zeros(1)}, str(folder / "model.safetensors"))
    assert index_weight_map(index, advice="x") == {"w": "model.safetensors"}
