"""Export audit, round 45: attention a loaded config.json asks for that the draft lacks, the
offline push advice, and the model card's training-data line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dspark_helpers import tiny_draft

from draftforge.train.export import ExportError, export_draft
from draftforge.train.hf_load import load_exported_draft


def _export(tmp_path):
    model = tiny_draft().eval()
    out = export_draft(model, tmp_path / "export", progress=lambda _: None)
    return model, out


def _edit_config(out: Path, **fields) -> None:
    config = json.loads((out / "config.json").read_text())
    for key, value in fields.items():
        if "." in key:
            outer, inner = key.split(".")
            config[outer] = {**(config.get(outer) or {}), inner: value}
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "fields, key",
    [
        ({"partial_rotary_factor": 0.25}, "partial_rotary_factor"),
        ({"rope_parameters.partial_rotary_factor": 0.5, "rope_parameters.rope_type": "default",
          "rope_parameters.rope_theta": 10000.0}, "rope_parameters.partial_rotary_factor"),
        ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
        ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16}, "layer_types"),
        ({"dflash_config.use_swa": True}, "dflash_config.use_swa"),
        ({"is_causal": True}, "is_causal"),
        ({"dflash_config.causal": True}, "dflash_config.causal"),
    ],
)
def test_a_config_asking_for_attention_the_draft_lacks_is_refused_naming_file_and_key(tmp_path, fields, key):
    """llama.cpp's converter reads each of these keys (a Qwen3.5-family draft rotates a quarter of
    each head); the loader ignored them and loaded a draft whose logits differ from the server's."""
    model, out = _export(tmp_path)
    _edit_config(out, **fields)
    with pytest.raises(ExportError) as err:
        load_exported_draft(out, embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight)
    assert str(out / "config.json") in str(err.value) and f"{key} is " in str(err.value)


def test_the_plain_spellings_of_full_attention_still_load_bit_identically(tmp_path):
    """What transformers writes for a plain Qwen3 config: no window, full attention everywhere,
    full rotary."""
    model, out = _export(tmp_path)
    _edit_config(out, use_sliding_window=False, sliding_window=4096, partial_rotary_factor=1.0,
                 layer_types=["full_attention"] * model.config.num_hidden_layers, is_causal=False)
    loaded = load_exported_draft(out, embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_offline_advice_names_every_variable_that_keeps_the_client_offline(tmp_path, monkeypatch):
    """With HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1 the advice was to unset HF_HUB_OFFLINE
    alone, after which huggingface_hub reads TRANSFORMERS_OFFLINE and is still offline."""
    from huggingface_hub import constants

    from draftforge.train.export import push_to_hub

    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "true"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    # huggingface_hub's rule once HF_HUB_OFFLINE alone is unset: still offline
    assert constants._is_true(None or env["TRANSFORMERS_OFFLINE"])
    with pytest.raises(RuntimeError) as err:
        push_to_hub(tmp_path, "me/draft")
    assert "unset HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE and run" in str(err.value)


def test_the_cards_training_data_line_says_when_the_run_read_only_the_first_samples():
    """data.num_samples 3: the run trained on the files' first 3 conversations; the card said
    'Files [...]' as if it had read them whole."""
    from draftforge.config import load_recipe
    from draftforge.train.export_cli import training_data_line

    tiny = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    limited = load_recipe(tiny, ["data.num_samples=3"])
    line = training_data_line(limited)
    assert line.startswith(f"Files {limited.data.train_files} (their first 3 conversations), ")
    whole = load_recipe(tiny, ["data.num_samples=null"])
    assert training_data_line(whole).startswith(f"Files {whole.data.train_files}, ")
