"""Round 6 of the export review: the shared safetensors index reader, which checkpoint an export
of a run picks, where a checkpoint's model.safetensors exports to, a config.json that is no object."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from dspark_helpers import tiny_draft
from safetensors.torch import save_file

from draftforge.errors import InputError
from draftforge.splitserve import sglang_backend
from draftforge.train.export import export_draft, load_training_checkpoint
from draftforge.train.hf_load import index_weight_map, load_exported_draft, read_safetensors_folder

ADVICE = "do the caller's thing"


def _sharded(folder: Path) -> tuple[Path, dict[str, str]]:
    """Two shards and the index naming them, written by hand."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"a.weight": torch.zeros(2), "b.weight": torch.ones(3)}, str(folder / "s1.safetensors"))
    save_file({"c.weight": torch.full((4,), 2.0)}, str(folder / "s2.safetensors"))
    weight_map = {"a.weight": "s1.safetensors", "b.weight": "s1.safetensors", "c.weight": "s2.safetensors"}
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 36}, "weight_map": weight_map}))
    return index, weight_map


def test_index_weight_map_reads_a_good_index(tmp_path):
    index, _ = _sharded(tmp_path)
    assert index_weight_map(index, advice=ADVICE) == {
        "a.weight": "s1.safetensors", "b.weight": "s1.safetensors", "c.weight": "s2.safetensors"}


@pytest.mark.parametrize("content,detail", [
    (b'{"weight_map": ', "JSONDecodeError"),
    (b"\xff\xfe\x00\x01", "UnicodeDecodeError"),
    (b'{"metadata": {}}', "KeyError"),
    (b"[1, 2]", "TypeError"),
    (b'{"weight_map": ["s1.safetensors"]}', "'weight_map' is not an object of tensor names to file names"),
    (b'{"weight_map": {"a.weight": 1}}', "'weight_map' is not an object of tensor names to file names"),
])  # fmt: skip
def test_index_weight_map_refuses_a_bad_index_naming_it(tmp_path, content, detail):
    index, _ = _sharded(tmp_path)
    index.write_bytes(content)
    with pytest.raises(InputError) as err:
        index_weight_map(index, advice=ADVICE)
    message = str(err.value)
    assert message.startswith(f"{index}: not a valid safetensors index ("), message
    assert detail in message and message.endswith(f"; {ADVICE}")


def test_index_weight_map_refuses_a_missing_shard_naming_it(tmp_path):
    index, _ = _sharded(tmp_path)
    (tmp_path / "s2.safetensors").unlink()
    with pytest.raises(InputError) as err:
        index_weight_map(index, advice=ADVICE)
    assert str(err.value) == f"{tmp_path / 's2.safetensors'}: listed in {index.name} but missing; {ADVICE}"


@pytest.mark.parametrize("content", [b"\xff\xfe\x00\x01", b'{"weight_map": {"fc.weight": 3}}'])
def test_loading_an_export_with_an_unreadable_index_is_an_input_error(tmp_path, content):
    """Before the merge, a non-UTF-8 index or a shard name that is no string escaped as a bare
    UnicodeDecodeError / TypeError."""
    out = export_draft(tiny_draft(), tmp_path / "export", max_shard_size_mb=0.01, progress=lambda _: None)
    index = out / "model.safetensors.index.json"
    index.write_bytes(content)
    with pytest.raises(InputError) as err:
        read_safetensors_folder(out)
    assert str(err.value).startswith(f"{index}: not a valid safetensors index (")
    assert str(err.value).endswith("; export the draft again")


def test_a_target_index_naming_a_missing_shard_says_which_and_what_to_do(tmp_path):
    index, _ = _sharded(tmp_path)
    (tmp_path / "s1.safetensors").unlink()
    with pytest.raises(InputError) as err:
        sglang_backend.read_weight(tmp_path, ["c.weight"], what="output head")
    assert str(err.value) == (f"{tmp_path / 's1.safetensors'}: listed in {index.name} but missing; the "
                              f"target checkpoint in {tmp_path} is incomplete or damaged; download it again")
    index.write_text('{"weight_map": {"c.weight": null}}')
    with pytest.raises(InputError, match=r"not a valid safetensors index .*download it again"):
        sglang_backend.read_weight(tmp_path, ["c.weight"], what="output head")


def test_a_target_index_is_read_through_it(tmp_path):
    _sharded(tmp_path)
    assert torch.equal(sglang_backend.read_weight(tmp_path, ["x.weight", "c.weight"]), torch.full((4,), 2.0))


def _write_checkpoint(folder: Path, model) -> None:
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "draft_config.json").write_text(json.dumps(asdict(model.config)))
    (folder / "trainer_state.json").write_text(json.dumps({"step": int(folder.name[5:13])}))
    (folder / "COMPLETE").write_text("done\n")


def test_exporting_a_run_picks_the_checkpoint_resume_picks(tmp_path):
    """A crashed save's step_N.tmp (marker written, rename not done) and a copy of a checkpoint
    under another name are not checkpoints: resume ignores them, and so must export."""
    from draftforge.train.checkpoint import find_resume

    run = tmp_path / "run"
    kept = tiny_draft(seed=1)
    _write_checkpoint(run / "checkpoints" / "step_00000010", kept)
    _write_checkpoint(run / "checkpoints" / "step_00000020.tmp", tiny_draft(seed=2))
    _write_checkpoint(run / "checkpoints" / "step_00000030-copy", tiny_draft(seed=3))
    assert find_resume(run, "auto") == run / "checkpoints" / "step_00000010"
    cfg, state = load_training_checkpoint(run)
    assert cfg == kept.config and torch.equal(state["fc.weight"], kept.fc.weight)


def test_a_checkpoints_model_file_exports_into_its_own_run_wherever_the_command_runs(tmp_path, monkeypatch):
    """As for the checkpoint folder: the recipe's relative train.output_dir (runs/tiny-debug) would
    put the export under whatever folder the command runs from, over another run's export there."""
    from draftforge.cli import main

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000004"
    from test_export import _tiny_debug_draft

    model = _tiny_debug_draft()  # the run's config.yaml (tiny-debug) describes its checkpoint
    _write_checkpoint(checkpoint, model)
    (tmp_path / "run" / "config.yaml").write_text(recipe.read_text())
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["export", str(checkpoint / "model.safetensors")]) == 0
    assert not (tmp_path / "elsewhere" / "runs").exists()
    loaded = load_exported_draft(tmp_path / "run" / "export", embed_tokens=model.embed_tokens.weight,
                                 lm_head=model.lm_head.weight)
    assert torch.equal(loaded.fc.weight, model.fc.weight)


def test_a_config_json_that_is_no_object_is_an_input_error(tmp_path):
    out = export_draft(tiny_draft(), tmp_path / "export", with_embeddings=True, progress=lambda _: None)
    (out / "config.json").write_text("[1, 2]")
    with pytest.raises(InputError) as err:
        load_exported_draft(out)
    assert str(err.value) == f"{out / 'config.json'}: a model config must be a JSON object, not a list"
