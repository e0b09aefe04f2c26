"""A target the user's recipe names wrongly is an InputError: the command says so, exit 2, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftforge.cli import main
from draftforge.errors import InputError
from draftforge.splitserve.config import TargetConfig
from draftforge.splitserve.target import build_target, check_layer_ids, load_tokenizer

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
# tiny-debug's target shape: a folder of this shape passes the recipe's own shape check
TINY_DEBUG_SHAPE = {"num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 49152,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                    "max_position_embeddings": 2048}


def remote_code_folder(path):
    """A model folder whose config points at code shipped with it (``auto_map``)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "mycustom", "architectures": ["MyForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_my.MyConfig",
                     "AutoModelForCausalLM": "modeling_my.MyForCausalLM"},
        **TINY_DEBUG_SHAPE,
    }))  # fmt: skip
    save_file({"w": torch.zeros(2)}, str(path / "model.safetensors"))
    return path


def test_remote_code_without_trust_is_an_input_error(tmp_path):
    folder = remote_code_folder(tmp_path / "custom")
    with pytest.raises(InputError, match="set target.trust_remote_code: true only if you trust"):
        build_target(TargetConfig(model=str(folder), dtype="float32"), [0])


def test_regenerate_command_refuses_remote_code_with_status_2(tmp_path, capsys):
    folder = remote_code_folder(tmp_path / "custom")
    status = main(["data", "regenerate", str(RECIPE), f"target.model={folder}",
                   f"train.output_dir={tmp_path / 'out'}", "data.num_samples=2", "--workers", "1",
                   "--device", "cpu", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2
    assert "error: target.model" in err and "trust_remote_code" in err
    assert "Traceback" not in err


def test_layer_ids_are_input_errors():
    with pytest.raises(InputError, match="final decoder layer"):
        check_layer_ids([3], 4)
    with pytest.raises(InputError, match="repeated"):
        check_layer_ids([1, 1], 4)


def test_load_tokenizer_of_a_missing_folder_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="neither a registered name"):
        load_tokenizer(TargetConfig(model=str(tmp_path / "nope")))
