"""Session 54: three messages a CLI review of session 53 found misleading, each said where the
user can act on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli_r15 import _run

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"


@pytest.mark.parametrize("raw", ["", "  "])
def test_a_blank_override_says_that_nothing_follows_the_equals_sign(raw, capsys):
    """'train.output_dir=  ' said only "expected str, got null": YAML reads a blank value as null."""
    code, _, err = _run(["config", "show", RECIPE, f"train.output_dir={raw}"], capsys)
    assert code == 2, err
    assert ("train.output_dir: expected str, got null (nothing follows '=' in the override, and YAML "
            "reads a blank value as null)") in err, err


def test_a_null_written_out_gets_no_blank_value_hint(capsys):
    code, _, err = _run(["config", "show", RECIPE, "train.output_dir=null"], capsys)
    assert code == 2 and "train.output_dir: expected str, got null" in err, err
    assert "nothing follows" not in err, err


def test_the_recipe_takes_a_fractional_shard_size_as_export_does(capsys):
    """export --max-shard-size-mb 0.5 worked while export.max_shard_size_mb=0.5 was refused as no integer."""
    code, out, err = _run(["config", "show", RECIPE, "export.max_shard_size_mb=0.5"], capsys)
    assert code == 0, err
    assert "max_shard_size_mb: 0.5" in out, out
    code, _, err = _run(["config", "show", RECIPE, "export.max_shard_size_mb=0"], capsys)
    assert code == 2 and "export.max_shard_size_mb: must be greater than 0" in err, err


@pytest.mark.parametrize("run_folder", [True, False])
def test_export_of_a_file_that_is_no_safetensors_names_what_to_pass(tmp_path, run_folder):
    """'export RUN/config.yaml' said that RUN/draft_config.json was missing."""
    from draftforge.train.export import ExportError, load_training_checkpoint

    folder = tmp_path / "run"
    (folder / "checkpoints" if run_folder else folder).mkdir(parents=True)
    given = folder / "config.yaml"
    given.write_text("train: {}\n")
    with pytest.raises(ExportError) as err:
        load_training_checkpoint(given)
    said = str(err.value)
    assert said.startswith(f"{given} is a file but no model.safetensors"), said
    if run_folder:
        assert said.endswith(f"pass the run directory {folder} for its newest complete checkpoint"), said
    else:
        assert said.endswith("pass a run directory, a checkpoint folder or a model.safetensors file"), said
    assert "draft_config.json" not in said, said
