"""Export to the serving format and load back: key table, config fields, sharding, atomicity, round trip."""

from __future__ import annotations

import json
import os

import pytest
import torch
from dspark_helpers import tiny_draft

from draftforge.errors import InputError
from draftforge.train import export as export_mod
from draftforge.train.export import (
    ExportError,
    export_draft,
    load_training_checkpoint,
    serving_config,
    tensor_table,
)
from draftforge.train.hf_load import config_from_serving, load_exported_draft

# Contract section 4: every field config.json must carry.
CONTRACT_FIELDS = {
    "model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling",
    "rms_norm_eps", "max_position_embeddings", "vocab_size", "tie_word_embeddings", "torch_dtype",
    "attention_bias", "hidden_act", "block_size", "mask_token_id", "target_layer_ids",
    "num_target_layers", "markov_rank", "markov_head_type", "enable_confidence_head",
    "confidence_head_with_markov",
}  # fmt: skip


def _block_outputs(model, seed: int = 7):
    """draft_block logits and confidences of a few blocks at different anchors (inference path)."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    aux = torch.randn(2, 20, cfg.num_context_features, generator=gen).to(model.fc.weight.dtype)
    anchor = torch.randint(0, cfg.vocab_size, (2,), generator=gen)
    outs = []
    with torch.no_grad():
        for pos in (1, 9, 20):
            hidden = model.block_forward(anchor, pos, aux[:, :pos])
            tokens, logits, conf = model.draft_block(hidden, anchor)
            outs += [tokens, logits, conf]
    return outs


@pytest.mark.parametrize(
    "head_type,with_embeddings,dtype",
    [
        ("vanilla", False, torch.float32),
        ("gated", True, torch.float32),
        ("rnn", False, torch.float32),
        ("vanilla", False, torch.bfloat16),
    ],
)
def test_round_trip_logits_bit_identical(tmp_path, head_type, with_embeddings, dtype):
    model = tiny_draft(markov_head_type=head_type, dtype=dtype).eval()
    out = export_draft(model, tmp_path / "export", with_embeddings=with_embeddings, progress=lambda _: None)
    loaded = load_exported_draft(
        out, embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight
    )
    assert loaded.config == model.config
    assert next(loaded.parameters()).dtype == dtype
    for original, reloaded in zip(_block_outputs(model), _block_outputs(loaded), strict=True):
        assert torch.equal(original, reloaded)


def test_unsorted_target_layers_export_ascending_with_fc_permuted_to_match(tmp_path):
    """SGLang hands its DSpark fc the layers ascending whatever config.json lists; the export
    lists them ascending and reorders fc's column blocks, so the served draft is the trained one."""
    from draftforge.splitserve.sglang_backend import captured_order

    model = tiny_draft(target_layer_ids=[4, 0, 2]).eval()
    out = export_draft(model, tmp_path / "export", progress=lambda _: None)
    config = json.loads((out / "config.json").read_text())
    assert config["target_layer_ids"] == config["dflash_config"]["target_layer_ids"] == [0, 2, 4]
    assert captured_order([4, 0, 2]) == [0, 2, 4]
    loaded = load_exported_draft(out, embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight)
    width = model.config.target_hidden_size
    block = {layer: model.fc.weight[:, k * width : (k + 1) * width] for k, layer in enumerate([4, 0, 2])}
    assert torch.equal(loaded.fc.weight, torch.cat([block[0], block[2], block[4]], dim=1))
    gen = torch.Generator().manual_seed(3)
    per_layer = {layer: torch.randn(2, 20, width, generator=gen) for layer in (4, 0, 2)}
    trained_order = torch.cat([per_layer[i] for i in (4, 0, 2)], dim=-1)
    served_order = torch.cat([per_layer[i] for i in (0, 2, 4)], dim=-1)
    anchor = torch.randint(0, model.config.vocab_size, (2,), generator=gen)
    with torch.no_grad():
        for pos in (1, 9, 20):
            want = model.draft_block(model.block_forward(anchor, pos, trained_order[:, :pos]), anchor)
            got = loaded.draft_block(loaded.block_forward(anchor, pos, served_order[:, :pos]), anchor)
            assert torch.equal(want[0], got[0])
            # fc sums its inputs in another order: equal up to float32 rounding
            torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)


def test_config_json_has_every_contract_field(tmp_path):
    model = tiny_draft()
    out = export_draft(model, tmp_path / "export", arch="LingDSparkModel", progress=lambda _: None)
    config = json.loads((out / "config.json").read_text())
    assert CONTRACT_FIELDS <= set(config), CONTRACT_FIELDS - set(config)
    assert config["model_type"] == "qwen3"
    assert config["architectures"] == ["LingDSparkModel"]
    assert config["tie_word_embeddings"] is False and config["rope_scaling"] is None
    assert config["attention_bias"] is False and config["hidden_act"] == "silu"
    assert 0 <= config["mask_token_id"] < config["vocab_size"]
    assert config["markov_rank"] == 8 and config["markov_head_type"] == "vanilla"
    assert config["block_size"] == 4 and config["target_layer_ids"] == [0, 2, 4]
    assert config["num_target_layers"] == 6 and config["head_dim"] == 8
    assert config["torch_dtype"] == "float32"
    assert "speculators_model_type" not in config  # SGLang refuses it
    nested = config["dflash_config"]
    assert {k: config[k] for k in nested} == nested
    # The mapping inverts exactly.
    assert config_from_serving(config) == model.config


def test_default_export_writes_no_embeddings_and_a_model_card(tmp_path):
    from safetensors import safe_open

    out = export_draft(tiny_draft(), tmp_path / "export", progress=lambda _: None)
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    assert "embed_tokens.weight" not in names and "lm_head.weight" not in names
    assert names == set(tensor_table(tiny_draft().config, with_embeddings=False))
    card = (out / "README.md").read_text()
    assert "--speculative-algorithm DSPARK" in card and "--speculative-num-draft-tokens 5" in card
    assert "--spec-type draft-dspark --spec-draft-n-max 4" in card
    assert "Add the flags the target itself needs to be served" in card  # tp size, remote code
    # the GGUF goes outside the folder (the converter's default is inside, where a later
    # export into the folder would refuse it as a file an export does not write)
    assert "--target-model-dir TARGET --outfile THIS.gguf" in card
    assert "--spec-draft-p-min P" in card  # tiny_draft has a confidence head
    # SGLang 0.5.23 builds the head only with SGLANG_RAGGED_VERIFY_MODE cap-accept or compact
    assert "`SGLANG_RAGGED_VERIFY_MODE=cap-accept`" in card
    assert "`--speculative-dspark-confidence-sts-path OUT.json`" in card
    assert "keep `--speculative-num-draft-tokens 5`" in card
    logged: list[str] = []
    plain = export_draft(tiny_draft(enable_confidence_head=False, confidence_head_with_markov=False),
                         tmp_path / "plain", progress=logged.append)  # fmt: skip
    plain_card = (plain / "README.md").read_text()
    assert "--spec-draft-p-min" not in plain_card and "sts-path" not in plain_card
    assert "no confidence head: SGLang serves it in its default verify mode" in plain_card
    assert any(line.startswith("note: This draft has no confidence head") for line in logged), logged


@pytest.mark.parametrize(
    "overrides,reason",
    [
        (dict(markov_head_type="gated"), "its Markov head is 'gated' and llama.cpp's converter supports only 'vanilla'"),
        (dict(markov_head_type="rnn"), "its Markov head is 'rnn' and llama.cpp's converter supports only 'vanilla'"),
        (dict(confidence_head_with_markov=False), "its confidence head reads the hidden state alone"),
    ],
)
def test_drafts_llamacpp_cannot_run_get_an_sglang_only_card_and_a_warning(tmp_path, overrides, reason):
    """llama.cpp's converter refuses non-vanilla heads; its runtime refuses a confidence head
    without the Markov input ([1, H] where it expects [H + r, 1]): no llama.cpp commands."""
    logged: list[str] = []
    out = export_draft(tiny_draft(**overrides), tmp_path / "export", progress=logged.append)
    card = (out / "README.md").read_text()
    assert "--speculative-algorithm DSPARK" in card
    assert "convert_hf_to_gguf" not in card and "llama-server" not in card
    assert "--spec-draft-p-min" not in card
    assert "SGLang only: llama.cpp cannot run this draft (" + reason in card
    warnings = [line for line in logged if line.startswith("warning: llama.cpp cannot run this draft")]
    assert len(warnings) == 1 and reason in warnings[0]


def test_with_embeddings_of_an_untied_target_keeps_the_embedding_out_of_llamacpp(tmp_path):
    """llama.cpp's converter drops a full-vocabulary lm_head and would keep embed_tokens as the
    draft's embedding and (tied) output head: every export with embeddings says has_embed_tokens
    false, so that llama.cpp uses the target's own."""
    untied = tiny_draft()
    assert not torch.equal(untied.embed_tokens.weight, untied.lm_head.weight)
    logged: list[str] = []
    out = export_draft(untied, tmp_path / "untied", with_embeddings=True, progress=logged.append)
    config = json.loads((out / "config.json").read_text())
    assert config["has_embed_tokens"] is False
    assert config_from_serving(config) == untied.config
    assert "`has_embed_tokens: false` makes llama.cpp's converter leave both out" in " ".join(
        (out / "README.md").read_text().split())
    assert any("has_embed_tokens false" in line for line in logged)

    tied = tiny_draft()
    with torch.no_grad():
        tied.lm_head.weight.copy_(tied.embed_tokens.weight)
    # a tied target's copy too (session 50): llama.cpp would serve the copy, which a bf16
    # export rounds, in place of the target's own; without embeddings there is nothing to drop
    out = export_draft(tied, tmp_path / "tied", with_embeddings=True, progress=lambda _: None)
    assert json.loads((out / "config.json").read_text())["has_embed_tokens"] is False
    out = export_draft(untied, tmp_path / "plain", with_embeddings=False, progress=lambda _: None)
    assert "has_embed_tokens" not in json.loads((out / "config.json").read_text())
    assert "has_embed_tokens" not in (out / "README.md").read_text()


def test_export_refuses_a_missing_tensor(tmp_path):
    model = tiny_draft()
    state = dict(model.state_dict())
    del state["layers.1.mlp.up_proj.weight"]
    with pytest.raises(ExportError, match=r"missing tensors: layers\.1\.mlp\.up_proj\.weight"):
        export_draft((state, model.config), tmp_path / "export", progress=lambda _: None)
    assert not (tmp_path / "export").exists()


def test_export_refuses_an_unexpected_tensor(tmp_path):
    model = tiny_draft()
    state = {**model.state_dict(), "markov_head.extra.weight": torch.zeros(2)}
    with pytest.raises(ExportError, match=r"unexpected tensors: markov_head\.extra\.weight"):
        export_draft((state, model.config), tmp_path / "export", progress=lambda _: None)
    assert not (tmp_path / "export").exists()


def test_export_refuses_a_wrong_shape(tmp_path):
    model = tiny_draft()
    state = {**model.state_dict(), "fc.weight": torch.zeros(3, 3)}
    with pytest.raises(ExportError, match=r"wrong shapes: fc\.weight"):
        export_draft((state, model.config), tmp_path / "export", progress=lambda _: None)


def test_loader_refuses_unexpected_tensors_too(tmp_path):
    from safetensors.torch import load_file, save_file

    out = export_draft(tiny_draft(), tmp_path / "export", with_embeddings=True, progress=lambda _: None)
    state = load_file(str(out / "model.safetensors"))
    state["stray.weight"] = torch.zeros(1)
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match="unexpected tensors: stray.weight"):
        load_exported_draft(out)


def test_markov_rank_zero_is_refused_with_a_clear_message(tmp_path):
    model = tiny_draft(markov_rank=0, confidence_head_with_markov=False)
    with pytest.raises(ExportError, match="markov_rank 0.*training checkpoint"):
        export_draft(model, tmp_path / "export", progress=lambda _: None)
    assert not (tmp_path / "export").exists()


def test_mask_token_outside_vocab_never_written():
    cfg = tiny_draft().config
    cfg.mask_token_id = cfg.vocab_size  # bypassing DSparkConfig's own check
    with pytest.raises(ExportError, match="mask_token_id 64 is outside"):
        serving_config(cfg, arch="Qwen3DSparkModel", dtype=torch.float32)


def test_sharding_with_index(tmp_path):
    model = tiny_draft()
    out = export_draft(model, tmp_path / "export", max_shard_size_mb=0.01, progress=lambda _: None)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == set(shards)
    assert set(index["weight_map"]) == set(tensor_table(model.config, with_embeddings=False))
    state = model.state_dict()
    expected_size = sum(state[k].numel() * state[k].element_size() for k in index["weight_map"])
    assert index["metadata"]["total_size"] == expected_size
    for shard in shards:  # every shard respects the limit unless it holds a single larger tensor
        from safetensors.torch import load_file

        tensors = load_file(str(out / shard))
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 0.01 * 1024 * 1024 or len(tensors) == 1
    loaded = load_exported_draft(out, embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight)
    for a, b in zip(_block_outputs(model), _block_outputs(loaded), strict=True):
        assert torch.equal(a, b)


def test_failed_export_leaves_no_folder_and_keeps_an_older_export(tmp_path, monkeypatch):
    old = export_draft(tiny_draft(seed=1), tmp_path / "export", progress=lambda _: None)
    before = {p.name: p.read_bytes() for p in old.iterdir()}

    def broken(state, folder, *, max_shard_size_mb):
        (folder / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(export_mod, "write_safetensors", broken)
    with pytest.raises(OSError, match="disk full"):
        export_draft(tiny_draft(seed=2), tmp_path / "export", progress=lambda _: None)
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    with pytest.raises(OSError, match="disk full"):
        export_draft(tiny_draft(seed=2), tmp_path / "fresh", progress=lambda _: None)
    assert not (tmp_path / "fresh").exists()
    assert sorted(os.listdir(tmp_path)) == ["export"]  # no temporary folders left behind


def test_export_replaces_an_older_export(tmp_path):
    export_draft(tiny_draft(seed=1), tmp_path / "export", progress=lambda _: None)
    new = tiny_draft(seed=2)
    out = export_draft(new, tmp_path / "export", progress=lambda _: None)
    loaded = load_exported_draft(out, embed_tokens=new.embed_tokens.weight, lm_head=new.lm_head.weight)
    assert torch.equal(loaded.fc.weight, new.fc.weight)
    assert sorted(os.listdir(tmp_path)) == ["export"]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_export_folder_gets_the_mode_mkdir_would_give(tmp_path, umask):
    """The staging folder comes from mkdtemp (0700); a server running as another user must
    still be able to read the export when the umask allows it."""
    old = os.umask(umask)
    try:
        out = export_draft(tiny_draft(), tmp_path / "export", progress=lambda _: None)
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    for item in out.iterdir():
        assert item.stat().st_mode & 0o777 == 0o666 & ~umask, item.name


def test_loader_reads_the_dflash_fields_nested_only(tmp_path):
    """SGLang accepts block_size, target_layer_ids, num_target_layers and mask_token_id
    under dflash_config alone; so does the loader, and it refuses the two copies disagreeing."""
    model = tiny_draft()
    raw = serving_config(model.config, arch="Qwen3DSparkModel", dtype=torch.float32)
    nested_only = {k: v for k, v in raw.items() if k not in raw["dflash_config"]}
    assert set(raw["dflash_config"]) == {"block_size", "target_layer_ids", "num_target_layers", "mask_token_id"}
    assert config_from_serving(nested_only) == model.config
    contradicting = dict(raw, dflash_config=dict(raw["dflash_config"], block_size=raw["block_size"] + 1))
    with pytest.raises(ExportError, match="block_size is .* at the top level but .* in dflash_config"):
        config_from_serving(contradicting, where="x/config.json")


@pytest.mark.parametrize(
    "field",
    [
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}},
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    ],
)
def test_loader_refuses_rope_scaling_it_cannot_apply(field):
    raw = serving_config(tiny_draft().config, arch="Qwen3DSparkModel", dtype=torch.float32)
    with pytest.raises(ExportError, match="x/config.json: rope scaling .* not supported"):
        config_from_serving(dict(raw, **field), where="x/config.json")
    plain = dict(raw, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert config_from_serving(plain) == tiny_draft().config


def test_export_refuses_to_replace_a_folder_that_is_not_an_export(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not an export"):
        export_draft(tiny_draft(), tmp_path / "mine", progress=lambda _: None)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_export_replaces_only_an_earlier_export_and_nothing_added_to_it(tmp_path):
    """A Hugging Face model folder has a config.json too: exporting into one deleted its
    tokenizer and weights. Only a folder whose config.json names a DSpark architecture and
    that holds only what an export writes is replaced."""
    model = tmp_path / "hf-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (model / "tokenizer.json").write_text("{}")
    (model / "model-00001-of-00004.safetensors").write_bytes(b"weights")
    before = {path.name: path.read_bytes() for path in model.iterdir()}
    with pytest.raises(ExportError) as err:
        export_draft(tiny_draft(), model, progress=lambda _: None)
    assert str(err.value) == (
        f"export destination {model} is a non-empty folder that is not an export (its config.json "
        "names ['LlamaForCausalLM'], not Qwen3DSparkModel or LingDSparkModel); refusing to "
        f"replace it; choose another --out or empty {model} first")
    assert {path.name: path.read_bytes() for path in model.iterdir()} == before
    # an earlier export is replaced, also when it was sharded; one with a file added is not
    out = export_draft(tiny_draft(), tmp_path / "export", progress=lambda _: None, max_shard_size_mb=0.01)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    export_draft(tiny_draft(), out, progress=lambda _: None)
    assert sorted(path.name for path in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    (out / "calibration.json").write_text("{}")
    with pytest.raises(ExportError, match=r"holds files an export does not write \(calibration\.json\)"):
        export_draft(tiny_draft(), out, progress=lambda _: None)
    assert (out / "calibration.json").read_text() == "{}"


def test_load_without_embeddings_needs_the_target(tmp_path):
    out = export_draft(tiny_draft(), tmp_path / "export", progress=lambda _: None)
    with pytest.raises(InputError, match="pass the target"):
        load_exported_draft(out)


def _edit_weight_map(out, edit):
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    edit(index["weight_map"])
    index_path.write_text(json.dumps(index))
    return index_path


def test_a_sharded_export_whose_index_disagrees_with_its_shards_is_an_input_error(tmp_path):
    out = export_draft(tiny_draft(), tmp_path / "export", max_shard_size_mb=0.01, progress=lambda _: None)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shard_of_norm, other = weight_map["norm.weight"], weight_map["fc.weight"]
    assert shard_of_norm != other
    kwargs = {"embed_tokens": torch.zeros(64, 32), "lm_head": torch.zeros(64, 32)}

    index = _edit_weight_map(out, lambda m: m.update({"norm.weight": other}))
    with pytest.raises(InputError) as err:
        load_exported_draft(out, **kwargs)
    assert str(err.value) == (f"{out / shard_of_norm}: holds tensor norm.weight, but {index} lists it "
                              f"in {other}; export the draft again")

    _edit_weight_map(out, lambda m: m.update({"norm.weight": shard_of_norm, "ghost.weight": other}))
    with pytest.raises(InputError) as err:
        load_exported_draft(out, **kwargs)
    assert str(err.value) == (f"{index}: tensors listed but absent from their shards: ghost.weight "
                              f"(in {other}); export the draft again")

    _edit_weight_map(out, lambda m: [m.pop("ghost.weight"), m.pop("norm.weight")])
    with pytest.raises(InputError, match=r"holds tensor norm\.weight, but .*index\.json does not list it"):
        load_exported_draft(out, **kwargs)


def _tiny_debug_draft():
    """A random draft of recipes/tiny-debug.yaml's draft section, as its run would train."""
    from pathlib import Path

    from draftforge.config import load_recipe
    from draftforge.splitserve.registry import resolve_target_shape
    from draftforge.train.config import build_dspark_config
    from draftforge.train.model import DSparkDraft

    cfg = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml")
    torch.manual_seed(0)
    return DSparkDraft(build_dspark_config(cfg.draft, resolve_target_shape(cfg.target)))


def _write_checkpoint(folder, model):
    from dataclasses import asdict

    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "draft_config.json").write_text(json.dumps(asdict(model.config)))


def test_load_training_checkpoint_picks_the_newest_complete_step(tmp_path):
    done, partial = tiny_draft(seed=1), tiny_draft(seed=2)
    _write_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000010", done)
    (tmp_path / "run" / "checkpoints" / "step_00000010" / "COMPLETE").touch()
    (tmp_path / "run" / "checkpoints" / "step_00000010" / "trainer_state.json").write_text("{}")  # complete, as resume reads it
    _write_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000020", partial)  # no marker
    cfg, state = load_training_checkpoint(tmp_path / "run")
    assert cfg == done.config
    assert torch.equal(state["fc.weight"], done.fc.weight)


def test_export_cli_end_to_end(tmp_path, capsys):
    from draftforge.cli import main

    model = tiny_draft(seed=4)
    _write_checkpoint(tmp_path / "ckpt", model)
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 0
    assert f"export_dir={tmp_path / 'out'}" in capsys.readouterr().out
    loaded = load_exported_draft(
        tmp_path / "out", embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight
    )
    for a, b in zip(_block_outputs(model), _block_outputs(loaded), strict=True):
        assert torch.equal(a, b)


def test_export_cli_on_a_full_disk_says_where_and_why_in_one_line(tmp_path, monkeypatch, capsys):
    """safetensors reports a failed write as its own SafetensorError, not an OSError."""
    import safetensors.torch
    from safetensors import SafetensorError

    from draftforge.cli import main

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    _write_checkpoint(tmp_path / "ckpt", tiny_draft())
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"draftforge export: error: writing the export to {tmp_path / 'out'} failed ("), err
    assert "No space left on device" in err and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no partial folder left


def test_a_checkpoint_exports_into_its_own_run_wherever_the_command_runs(tmp_path, monkeypatch):
    """Without --out, a checkpoint folder exports to <its run>/export: the recipe's
    train.output_dir (runs/tiny-debug, relative) would put it under whatever folder the
    command runs from."""
    from pathlib import Path

    from draftforge.cli import main

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000004"
    _write_checkpoint(checkpoint, _tiny_debug_draft())
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["export", str(checkpoint), "--recipe", str(recipe)]) == 0
    assert (tmp_path / "run" / "export" / "config.json").is_file()
    assert not (tmp_path / "elsewhere" / "runs").exists()


def test_push_to_hub_offline_fails_clearly(tmp_path, monkeypatch, capsys):
    from draftforge.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _write_checkpoint(tmp_path / "ckpt", tiny_draft())
    status = main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--push-to-hub", "me/draft"])
    assert status == 1
    err = capsys.readouterr().err
    assert "HF_HUB_OFFLINE" in err and "export is complete" in err
    assert (tmp_path / "out" / "config.json").is_file()


def test_with_embeddings_needs_them_in_the_state(tmp_path):
    model = tiny_draft()
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(ExportError, match="with_embeddings needs embed_tokens.weight and lm_head.weight") as info:
        export_draft((state, model.config), tmp_path / "export", with_embeddings=True, progress=lambda _: None)
    # it names what is there (it said "has none" of a state holding embed_tokens; round 58)
    assert "this checkpoint has only embed_tokens.weight, not lm_head.weight;" in str(info.value)
    bare = {k: v for k, v in state.items() if k != "embed_tokens.weight"}
    with pytest.raises(ExportError, match="this checkpoint has neither;"):
        export_draft((bare, model.config), tmp_path / "export", with_embeddings=True, progress=lambda _: None)


def test_export_cli_model_card_carries_recipe_and_acceptance_table(tmp_path):
    from pathlib import Path

    from draftforge.train.export_cli import main

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    _write_checkpoint(tmp_path / "ckpt", _tiny_debug_draft())
    table = tmp_path / "report.md"
    table.write_text("| workload | method | acceptance length |\n| gsm8k | dspark | 3.21 |\n")
    assert main([str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--recipe", str(recipe),
                 "--eval-report", str(table)]) == 0  # fmt: skip
    card = (tmp_path / "out" / "README.md").read_text()
    assert "DSpark draft for random" in card and "| gsm8k | dspark | 3.21 |" in card
    assert "## Recipe" in card and "markov_rank: 16" in card and "## Training data" in card


def _run_with_report(root, draft):
    """A run with one complete checkpoint and an eval report (report.md + report.json of ``draft``)."""
    run = root / "run"
    checkpoint = run / "checkpoints" / "step_00000010"
    _write_checkpoint(checkpoint, tiny_draft(seed=3))
    (checkpoint / "COMPLETE").touch()
    (checkpoint / "trainer_state.json").write_text("{}")  # complete, as resume reads it
    (run / "eval").mkdir()
    (run / "eval" / "report.md").write_text("| workload | dspark AL |\n| gsm8k | 4.99 |\n")
    (run / "eval" / "report.json").write_text(json.dumps({"draft": draft}))
    return run, checkpoint


@pytest.mark.parametrize("measured", ["another draft", "this run", "its checkpoint", "its export",
                                      "an earlier checkpoint"])
def test_a_runs_eval_report_goes_into_the_card_only_if_it_measured_this_draft(tmp_path, capsys, measured):
    from draftforge.train.export_cli import main

    drafts = {"another draft": "/elsewhere/other-draft", "this run": "{run}",
              "its checkpoint": "{run}/checkpoints/step_00000010", "its export": "{run}/export",
              "an earlier checkpoint": "{run}"}
    run, checkpoint = _run_with_report(tmp_path, drafts[measured].format(run=tmp_path / "run"))
    if measured == "an earlier checkpoint":  # measured before this checkpoint was complete
        done = (checkpoint / "COMPLETE").stat().st_mtime
        for name in ("report.md", "report.json"):  # one evaluation writes both
            os.utime(run / "eval" / name, (done - 60, done - 60))
    assert main([str(run)]) == 0
    card = (run / "export" / "README.md").read_text()
    out = capsys.readouterr().out
    report = run / "eval" / "report.md"
    if measured in ("this run", "its checkpoint", "its export"):
        assert "| gsm8k | 4.99 |" in card and "Not measured" not in card
        assert f"model card: acceptance table from {report}\n" in out
    else:
        assert "| gsm8k | 4.99 |" not in card and "Not measured at export time" in card
        why = ("measured draft /elsewhere/other-draft, not this run, its checkpoint step_00000010 or its export"
               if measured == "another draft" else "is older than checkpoint step_00000010")
        assert f"model card: {report} not used ({run / 'eval' / 'report.json'} {why}" in out
        assert "acceptance table from" not in out


def test_an_explicit_eval_report_is_used_and_named(tmp_path, capsys):
    from draftforge.train.export_cli import main

    run, _ = _run_with_report(tmp_path, "/elsewhere/other-draft")
    table = tmp_path / "mine.md"
    table.write_text("| gsm8k | 3.21 |\n")
    assert main([str(run), "--eval-report", str(table)]) == 0
    assert "| gsm8k | 3.21 |" in (run / "export" / "README.md").read_text()
    out = capsys.readouterr().out
    assert f"model card: acceptance table from {table}\n" in out and "not used" not in out


@pytest.mark.parametrize("regenerate", [True, False])
def test_the_cards_training_data_line_gives_sampling_settings_only_for_regenerated_data(tmp_path, regenerate):
    from pathlib import Path

    from draftforge.config import load_recipe
    from draftforge.train.export_cli import main

    tiny = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    loaded = load_recipe(tiny, [f"data.regenerate={str(regenerate).lower()}"])
    assert loaded.data.regenerate is regenerate
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(loaded.to_yaml())
    _write_checkpoint(tmp_path / "ckpt", _tiny_debug_draft())
    assert main([str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--recipe", str(recipe)]) == 0
    card = (tmp_path / "out" / "README.md").read_text()
    data = card.split("## Training data\n\n")[1].split("\n")[0]
    files, length = loaded.data.train_files, loaded.data.max_length
    if regenerate:
        g = loaded.target.generation
        assert data == (f"Files {files}, answers regenerated by the target (temperature {g.temperature}, "
                        f"top_p {g.top_p}, top_k {g.top_k}, thinking {g.enable_thinking}), max length {length}.")
    else:
        assert data == f"Files {files}, answers as the files give them (not regenerated by the target), max length {length}."
        assert "temperature" not in data and "thinking" not in data


@pytest.mark.parametrize("refuse", [None, 401])
def test_push_to_hub_uploads_the_export_through_huggingface_hub(tmp_path, monkeypatch, capsys, refuse):
    """The real huggingface_hub client against a loopback stand-in of the Hub's upload API."""
    from fake_hub import FakeHub
    from huggingface_hub import constants

    from draftforge.cli import main

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    _write_checkpoint(tmp_path / "ckpt", tiny_draft())
    out = tmp_path / "out"
    with FakeHub(refuse_with=refuse) as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the suite sets it at import
        status = main(["export", str(tmp_path / "ckpt"), "--out", str(out), "--push-to-hub", "me/draft"])
    captured = capsys.readouterr()
    exported = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert {"config.json", "model.safetensors", "README.md"} <= set(exported)
    if refuse is None:
        assert status == 0, captured.err
        assert hub.repos["me/draft"]["visibility"] == "private"
        assert hub.files["me/draft"] == exported  # every file, byte for byte
        assert [c["summary"] for c in hub.commits] == ["draftforge export"]
        assert hub.validated == [exported["README.md"].decode()]
        assert "pushed to https://huggingface.co/me/draft" in captured.out
    else:
        assert status == 1 and not hub.files
        assert "push to the Hugging Face Hub (me/draft) failed" in captured.err
        assert "export itself is complete" in captured.err


def test_a_push_replaces_an_earlier_pushs_shards_and_index(tmp_path, monkeypatch):
    """A sharded export pushed, then a single-file one to the same repo: the repo holds the new
    files only (a stale index left there would make SGLang load the old shards)."""
    from fake_hub import FakeHub
    from huggingface_hub import constants

    from draftforge.train.export import push_to_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    sharded = export_draft(tiny_draft(seed=1), tmp_path / "sharded", max_shard_size_mb=0.01,
                           progress=lambda _: None)
    single = export_draft(tiny_draft(seed=2), tmp_path / "single", progress=lambda _: None)
    with FakeHub() as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the suite sets it at import
        push_to_hub(sharded, "me/draft")
        assert "model.safetensors.index.json" in hub.files["me/draft"]
        hub.files["me/draft"][".gitattributes"] = b"*.safetensors filter=lfs\n"  # the Hub's own
        push_to_hub(single, "me/draft")
    expected = {p.name: p.read_bytes() for p in single.iterdir()}
    assert hub.files["me/draft"] == {**expected, ".gitattributes": b"*.safetensors filter=lfs\n"}
    assert len(hub.commits) == 2


def test_a_bf16_runs_frozen_matrices_go_out_in_the_drafts_dtype(tmp_path):
    """A single or deepspeed bf16 run keeps embed_tokens and lm_head in bf16 beside fp32
    weights; --with-embeddings writes them in fp32, exactly their values, and loads back."""
    model = tiny_draft()
    state = dict(model.state_dict())
    for name in ("embed_tokens.weight", "lm_head.weight"):
        state[name] = state[name].to(torch.bfloat16)
    out = export_draft((state, model.config), tmp_path / "export", with_embeddings=True, progress=lambda _: None)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    from safetensors.torch import load_file

    written = load_file(str(out / "model.safetensors"))
    for name in ("embed_tokens.weight", "lm_head.weight"):
        assert written[name].dtype == torch.float32 and torch.equal(written[name], state[name].float())
    assert load_exported_draft(out).embed_tokens.weight.dtype == torch.float32


def test_export_flushes_every_file_before_the_folder_takes_its_name(tmp_path, monkeypatch):
    """Atomic against a crash is not durable against a power cut: the files are fsynced
    in the staging folder before it is renamed into place."""
    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, export_mod.replace_dir
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    monkeypatch.setattr(export_mod, "replace_dir", lambda src, dst: (renamed.append(list(synced)), real_replace(src, dst)))
    export_draft(tiny_draft(), tmp_path / "export", progress=lambda _: None)
    before = {os.path.basename(p) for p in renamed[0]}
    assert {"config.json", "model.safetensors", "README.md"} <= before


def test_a_report_written_from_another_folder_is_found_by_its_draft_path(tmp_path, monkeypatch):
    """report.json's "draft" is the path as typed, relative to where eval ran; its
    "draft_path" is absolute, so the export finds the report from any folder."""
    from draftforge.train.export_cli import main

    run, _ = _run_with_report(tmp_path, "export")  # typed in the run folder: relative
    written = json.loads((run / "eval" / "report.json").read_text())
    written["draft_path"] = str(run / "export")
    (run / "eval" / "report.json").write_text(json.dumps(written))
    monkeypatch.chdir(tmp_path)  # "export" here is not the run's export
    assert main([str(run)]) == 0
    assert "| gsm8k | 4.99 |" in (run / "export" / "README.md").read_text()


def test_a_recipe_that_does_not_describe_the_checkpoint_is_refused(tmp_path, capsys):
    """The model card's recipe comes from --recipe: a checkpoint of another shape (tiny_draft:
    hidden 32, rank 8) exported with tiny-debug's recipe (hidden 64, rank 16) wrote a card whose
    table and recipe disagreed."""
    from pathlib import Path

    from draftforge.cli import main

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    _write_checkpoint(tmp_path / "ckpt", tiny_draft())
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--recipe", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert f"the recipe {recipe} does not describe the checkpoint {tmp_path / 'ckpt'}" in err
    assert "draft.hidden_size: recipe 64, checkpoint 32" in err and "draft.markov_rank: recipe 16, checkpoint 8" in err
    assert not (tmp_path / "out").exists()
