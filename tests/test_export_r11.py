"""Export and load back, round 11: config fields of the wrong JSON type (config.json and a
checkpoint's draft_config.json) are refused naming file and key, an --eval-report that is
no markdown table, a run directory that has saved no checkpoint."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from dspark_helpers import tiny_draft
from safetensors.torch import save_file

from draftforge.cli import main
from draftforge.errors import InputError
from draftforge.train.export import export_draft, load_training_checkpoint
from draftforge.train.hf_load import load_exported_draft


def _export(tmp_path):
    model = tiny_draft(seed=3).eval()
    return model, export_draft(model, tmp_path / "export", progress=lambda _: None)


def _checkpoint(folder, model, **config_changes):
    """A training checkpoint folder of ``model`` whose draft_config.json has ``config_changes``."""
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "draft_config.json").write_text(json.dumps({**asdict(model.config), **config_changes}))
    return folder


# each was read by int()/float(): silently cut (8.7 -> 8, true -> 1, [1.5] -> [1]) or refused
# with "invalid literal for int()" and no key
@pytest.mark.parametrize("key,value", [
    ("block_size", 4.5), ("markov_rank", True), ("target_layer_ids", [0, 2.5, 4]), ("vocab_size", "64"),
    ("hidden_size", None), ("target_layer_ids", 3), ("rms_norm_eps", "tiny"), ("max_position_embeddings", [256]),
])  # fmt: skip
def test_a_config_json_field_of_the_wrong_type_is_refused_naming_file_and_key(tmp_path, key, value):
    model, folder = _export(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config[key] = value
    config.pop("dflash_config")  # else the nested copy of block_size/target_layer_ids wins or disagrees
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError) as info:
        load_exported_draft(folder, embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight)
    assert str(info.value).startswith(f"{folder / 'config.json'}: {key} must be "), info.value
    assert repr(value) in str(info.value)


def test_a_size_written_as_a_float_is_refused_as_servers_would_fail_on_it(tmp_path):
    """``num_hidden_layers: 2.0`` loads into transformers' config as a float, which SGLang's
    layer loop cannot use: the export would not serve, so loading it back refuses it too."""
    model, folder = _export(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = float(config["num_hidden_layers"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=r"config.json: num_hidden_layers must be an integer, got 2\.0"):
        load_exported_draft(folder, embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight)


@pytest.mark.parametrize("key,value,kind", [
    ("enable_confidence_head", "false", "true or false"),  # was exported as the string "false"
    ("markov_rank", "8", "an integer"),
    ("target_layer_ids", ["0", "2", "4"], "a list of integers"),
    ("rope_theta", True, "a number"),
])  # fmt: skip
def test_a_draft_config_field_of_the_wrong_type_is_refused_naming_file_and_key(tmp_path, capsys, key, value, kind):
    checkpoint = _checkpoint(tmp_path / "ckpt", tiny_draft(), **{key: value})
    config = checkpoint / "draft_config.json"
    with pytest.raises(InputError) as info:
        load_training_checkpoint(checkpoint)
    assert f"{config}: not a valid draft config: {key} must be {kind}, got {value!r}" in str(info.value)
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "out")]) == 2
    assert f"{config}: not a valid draft config: {key} must be {kind}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_draft_config_that_is_no_object_is_refused_naming_it(tmp_path):
    checkpoint = _checkpoint(tmp_path / "ckpt", tiny_draft())
    (checkpoint / "draft_config.json").write_text("[1, 2]")
    with pytest.raises(InputError, match=r"draft_config\.json: not a valid draft config: .*not a list"):
        load_training_checkpoint(checkpoint)


@pytest.mark.parametrize("given,why", [
    ("acceptance_length.png", "not a markdown eval report (not UTF-8 text)"),
    ("report.json", "is JSON (an eval's report.json?)"),
    ("notes.md", "holds no markdown table"),
])  # fmt: skip
def test_an_eval_report_that_is_no_markdown_table_is_refused_before_exporting(tmp_path, capsys, given, why):
    checkpoint = _checkpoint(tmp_path / "ckpt", tiny_draft())
    (tmp_path / "acceptance_length.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff")
    (tmp_path / "report.json").write_text(json.dumps({"draft": str(checkpoint), "results": []}))
    (tmp_path / "notes.md").write_text("acceptance was good\n")
    report = tmp_path / given
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "out"), "--eval-report", str(report)]) == 2
    err = capsys.readouterr().err
    assert f"draftforge export: error: --eval-report {report}: {why}" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_runs_eval_report_that_is_no_table_leaves_the_card_unmeasured(tmp_path, capsys):
    """The run's own report.md (not asked for) does not stop the export: the card says Not measured."""
    run = tmp_path / "run"
    checkpoint = _checkpoint(run / "checkpoints" / "step_00000010", tiny_draft())
    (checkpoint / "COMPLETE").touch()
    (checkpoint / "trainer_state.json").write_text("{}")  # complete, as resume reads it
    (run / "eval").mkdir()
    (run / "eval" / "report.md").write_bytes(b"\xff\xfe binary")
    (run / "eval" / "report.json").write_text(json.dumps({"draft": str(run)}))
    assert main(["export", str(run)]) == 0
    card = (run / "export" / "README.md").read_text()
    assert "Not measured at export time" in card and "binary" not in card
    out = capsys.readouterr().out
    assert f"model card: not used: {run / 'eval' / 'report.md'}: not a markdown eval report" in out
    assert "acceptance table from" not in out


def test_a_run_directory_without_checkpoints_is_named_as_such(tmp_path, capsys):
    """Not "pass a run directory" to a user who passed one that has saved no checkpoint yet."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text("step 1\n")
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{run}: no model.safetensors found in it and no checkpoints/ folder" in err
    assert "neither a checkpoint folder nor a run directory that has saved a checkpoint" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("spelling,key", [
    ({"rope_theta": True}, "rope_theta"),  # float(True) loaded a draft with RoPE base 1.0
    ({"rope_theta": "10000"}, "rope_theta"),
    ({"rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}},
     "rope_parameters.rope_theta"),
    ({"rope_theta": None, "rope_scaling": {"rope_type": "default", "rope_theta": False}},
     "rope_scaling.rope_theta"),
])  # fmt: skip
def test_a_rope_base_that_is_no_json_number_is_refused_naming_file_and_key(tmp_path, spelling, key):
    model, folder = _export(tmp_path)
    config = {**json.loads((folder / "config.json").read_text()), **spelling}
    (folder / "config.json").write_text(json.dumps(config))
    value = spelling.get("rope_parameters", spelling.get("rope_scaling", spelling))["rope_theta"]
    with pytest.raises(InputError) as info:
        load_exported_draft(folder, embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight)
    assert str(info.value) == f"{folder / 'config.json'}: {key} must be a number, got {value!r}"


def test_a_rope_base_under_rope_parameters_still_loads_exactly(tmp_path):
    """transformers 5 spelling: no top-level rope_theta, the base under rope_parameters."""
    model, folder = _export(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    theta = config.pop("rope_theta")
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_exported_draft(folder, embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight)
    assert loaded.config.rope_theta == model.config.rope_theta


def test_a_target_folder_whose_rope_base_is_no_number_is_named_with_its_file(tmp_path):
    """The target's own config.json goes through the same reader: its message names the file."""
    from draftforge.errors import InputError
    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.registry import resolve_target_shape

    config = {"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 32, "rope_theta": "10000"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    target = TargetConfig(model=str(tmp_path))
    with pytest.raises(InputError, match=rf"{tmp_path}/config.json: rope_theta must be a number, got '10000'"):
        resolve_target_shape(target, strict=True)
    config["rope_theta"] = 10000
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve_target_shape(target, strict=True).rope_theta == 10000.0


def test_no_with_embeddings_overrides_a_recipe_that_asks_for_them(tmp_path):
    """--with-embeddings could only turn them on: a recipe with export.with_embeddings true
    left no way to export without them."""
    from pathlib import Path

    from test_export import _tiny_debug_draft, _write_checkpoint

    from draftforge.cli import main

    recipe = tmp_path / "recipe.yaml"
    tiny = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    recipe.write_text(tiny.read_text().replace("\nexport:\n", "\nexport:\n  with_embeddings: true\n"))
    _write_checkpoint(tmp_path / "ckpt", _tiny_debug_draft())

    def names(out):
        with open(out / "model.safetensors", "rb") as handle:
            header = handle.read(int.from_bytes(handle.read(8), "little"))
        return set(json.loads(header)) - {"__metadata__"}

    argv = ["export", str(tmp_path / "ckpt"), "--recipe", str(recipe), "--out"]
    assert main([*argv, str(tmp_path / "with")]) == 0
    assert main([*argv, str(tmp_path / "without"), "--no-with-embeddings"]) == 0
    assert names(tmp_path / "with") - names(tmp_path / "without") == {"embed_tokens.weight", "lm_head.weight"}
