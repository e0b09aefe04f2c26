"""Export and load back, round 9: a target of another shape, a checkpoint that does not match
its config, configs as other writers spell them (plain RoPE under rope_scaling, no
confidence_head_with_markov), a config.json that is not text."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
import torch
from dspark_helpers import tiny_draft

from draftforge.errors import InputError
from draftforge.train.export import export_draft, load_training_checkpoint, serving_config
from draftforge.train.hf_load import config_from_serving, load_exported_draft, read_serving_config


def _outputs(model):
    """draft_block tokens, logits and confidences of a few blocks (inference path)."""
    cfg = model.config
    gen = torch.Generator().manual_seed(11)
    aux = torch.randn(2, 16, cfg.num_context_features, generator=gen)
    anchor = torch.randint(0, cfg.vocab_size, (2,), generator=gen)
    outs = []
    with torch.no_grad():
        for pos in (1, 7, 16):
            outs += model.draft_block(model.block_forward(anchor, pos, aux[:, :pos]), anchor)
    return outs


class _Target:
    """The two methods of a TargetEngine that loading a draft calls."""

    def __init__(self, embed_tokens, lm_head):
        self._embed_tokens, self._lm_head = embed_tokens, lm_head

    def embed_tokens_weight(self):
        return self._embed_tokens

    def lm_head_weight(self):
        return self._lm_head


@pytest.mark.parametrize("with_embeddings", [False, True])
def test_a_target_of_another_shape_is_refused_naming_the_export(tmp_path, with_embeddings):
    """A draft loaded against another target (65 token rows where the draft has 64) is an input
    error naming the folder and both shapes; an export that holds its own embeddings is no
    longer loaded beside a target it does not fit."""
    model = tiny_draft()
    out = export_draft(model, tmp_path / "export", with_embeddings=with_embeddings, progress=lambda _: None)
    other = _Target(torch.zeros(65, 32), torch.zeros(65, 32))
    with pytest.raises(InputError) as err:
        load_exported_draft(out, target=other)
    assert str(err.value) == (
        f"{out}: the target's embed_tokens is (65, 32), but the draft's config.json has vocab_size 64 "
        "and hidden_size 32: the draft was trained for another target; pass the target it was "
        "trained against")
    with pytest.raises(InputError, match=r"the target's lm_head is \(64, 16\)"):
        load_exported_draft(out, embed_tokens=model.embed_tokens.weight, lm_head=torch.zeros(64, 16))
    loaded = load_exported_draft(out, target=_Target(model.embed_tokens.weight, model.lm_head.weight))
    for want, got in zip(_outputs(model), _outputs(loaded), strict=True):
        assert torch.equal(want, got)


def test_a_checkpoint_that_does_not_match_its_config_is_named(tmp_path, capsys):
    """A checkpoint's tensors that do not fit its draft_config.json (an older tensor name here):
    the error names model.safetensors and its config, for export and for every other reader."""
    from safetensors.torch import save_file

    from draftforge.cli import main

    model = tiny_draft()
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    state["markov_head.w1.weight"] = state.pop("markov_head.markov_w1.weight")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    save_file(state, str(checkpoint / "model.safetensors"))
    (checkpoint / "draft_config.json").write_text(json.dumps(asdict(model.config)))
    expected = (f"{checkpoint / 'model.safetensors'} (with its draft_config.json) does not match the "
                "DSpark key table for this config")
    with pytest.raises(InputError) as err:
        load_training_checkpoint(checkpoint)
    assert str(err.value).startswith(expected)
    assert str(err.value).endswith("missing tensors: markov_head.markov_w1.weight; "
                                   "unexpected tensors: markov_head.w1.weight")
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "out")]) == 2
    assert f"draftforge export: error: {expected}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("type_key", ["rope_type", "type"])
def test_plain_rope_spelled_under_rope_scaling_loads_with_its_base(tmp_path, type_key):
    """Newer transformers write a plain RoPE config as rope_scaling {rope_theta, rope_type:
    default} without a top-level rope_theta: plain RoPE with that base, not a scaling to refuse
    (nor a base silently replaced by 10000)."""
    model = tiny_draft(rope_theta=500000.0)
    out = export_draft(model, tmp_path / "export", progress=lambda _: None)
    raw = json.loads((out / "config.json").read_text())
    del raw["rope_theta"]
    raw["rope_scaling"] = {"rope_theta": 500000, type_key: "default"}
    (out / "config.json").write_text(json.dumps(raw))
    assert config_from_serving(raw).rope_theta == 500000.0
    loaded = load_exported_draft(out, embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight)
    assert loaded.config == model.config
    for want, got in zip(_outputs(model), _outputs(loaded), strict=True):
        assert torch.equal(want, got)
    # a scaling stays refused, whichever key names its type
    with pytest.raises(InputError, match="rope scaling .* is not supported"):
        config_from_serving(dict(raw, rope_scaling={type_key: "linear", "factor": 2.0}))


def test_a_config_without_confidence_head_with_markov_reads_it_as_sglang_does(tmp_path):
    """SGLang's build_confidence_head defaults confidence_head_with_markov to markov_rank > 0:
    a config without the field describes a head over [h; W1[x]], [1, H + r]."""
    model = tiny_draft()  # markov_rank 8, confidence head with Markov: proj [1, 40]
    out = export_draft(model, tmp_path / "export", progress=lambda _: None)
    raw = json.loads((out / "config.json").read_text())
    del raw["confidence_head_with_markov"]
    (out / "config.json").write_text(json.dumps(raw))
    loaded = load_exported_draft(out, embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight)
    assert loaded.config == model.config
    for want, got in zip(_outputs(model), _outputs(loaded), strict=True):
        assert torch.equal(want, got)
    # and a Markov-free head needs the field said: false
    plain = serving_config(replace(model.config, confidence_head_with_markov=False),
                           arch="Qwen3DSparkModel", dtype=torch.float32)
    assert config_from_serving(plain).confidence_head_with_markov is False
    del plain["confidence_head_with_markov"]
    assert config_from_serving(plain).confidence_head_with_markov is True


def test_a_config_json_that_is_not_text_is_an_input_error(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{\x00}\x00")  # UTF-16, as some editors save
    with pytest.raises(InputError) as err:
        read_serving_config(tmp_path)
    assert str(err.value) == (f"{tmp_path / 'config.json'}: not UTF-8 text (byte 0: invalid start byte); "
                              "export the draft again")


@pytest.mark.parametrize("key", ["enable_confidence_head", "confidence_head_with_markov"])
def test_a_flag_written_as_a_string_is_refused_not_read_as_true(key):
    """bool("false") is True: a hand-edited "false" built a confidence head the file said it
    had not."""
    from draftforge.train.export import ExportError

    raw = serving_config(tiny_draft().config, arch="Qwen3DSparkModel", dtype=torch.float32)
    raw[key] = "false"
    with pytest.raises(ExportError, match=f"x/config.json: {key} must be true or false, got 'false'"):
        config_from_serving(raw, where="x/config.json")
    raw[key] = False
    assert getattr(config_from_serving(raw), key) is False
