"""Export, load-back and the llama.cpp conversion: round 20 fixes.

- the loader refuses a config.json whose ``hidden_act``, ``attention_bias`` or ``architectures``
  describe a model draftforge's draft is not (it used to load it as SiLU without biases);
- an export holding only one of ``embed_tokens.weight`` / ``lm_head.weight`` (each optional in
  the contract) loads, taking the other from the target;
- the exporter checks the key table before the dtypes: a stray tensor of another dtype is an
  unexpected tensor, not "mixed dtypes";
- ``llamacpp.convert`` writes into a temporary folder of its own: two conversions into one work
  folder no longer share (and delete) one temporary file;
- ``push_to_hub`` recognises offline mode as huggingface_hub does (``HF_HUB_OFFLINE=true``, ``yes``,
  ``on``, or ``TRANSFORMERS_OFFLINE``), not only ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from dspark_helpers import tiny_draft
from safetensors.torch import load_file, save_file

from draftforge.eval import llamacpp
from draftforge.train.export import ExportError, export_draft, serving_config
from draftforge.train.hf_load import config_from_serving, load_exported_draft


def _quiet(_line: str) -> None:
    pass


def _outputs(model, seed: int = 3) -> list[torch.Tensor]:
    """Block logits of ``model`` at a few anchors: equal for two drafts only if they compute alike."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, 16, cfg.num_context_features, generator=gen)
    anchor = torch.tensor([7])
    with torch.no_grad():
        return [t for pos in (1, 9) for t in model.draft_block(model.block_forward(anchor, pos, aux[:, :pos]), anchor)]


# ----------------------------------------------------------------------------- what the draft implements


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("hidden_act", "gelu", "hidden_act is 'gelu', but draftforge's draft implements 'silu' only"),
        ("hidden_act", "swish", "hidden_act is 'swish', but draftforge's draft implements 'silu' only"),
        ("attention_bias", True, "attention_bias is True, but draftforge's draft has no attention biases: "
                                 "only false is supported"),
        ("attention_bias", "false", "attention_bias is 'false', but draftforge's draft has no attention "
                                    "biases: only false is supported"),
        ("architectures", ["Qwen3ForCausalLM"], 'architectures is \\["Qwen3ForCausalLM"\\], but a DSpark '
                                                'draft\'s is \\["Qwen3DSparkModel"\\] or \\["LingDSparkModel"\\]'),
        ("architectures", "Qwen3DSparkModel", 'architectures is "Qwen3DSparkModel", but'),
        ("architectures", ["Qwen3DSparkModel", "LingDSparkModel"], "architectures is .* but a DSpark"),
    ],
)
def test_a_config_describing_another_model_is_refused_naming_the_file_key_and_supported_value(key, value, message):
    """These used to load as a SiLU draft without biases: silently another model than the one a
    server builds from the same file."""
    raw = serving_config(tiny_draft().config, arch="Qwen3DSparkModel", dtype=torch.float32)
    raw[key] = value
    with pytest.raises(ExportError, match=f"^x/config.json: {message}"):
        config_from_serving(raw, where="x/config.json")


def test_an_export_folder_with_gelu_is_refused_naming_its_config_json(tmp_path):
    model = tiny_draft()
    out = export_draft(model, tmp_path / "export", progress=_quiet)
    raw = json.loads((out / "config.json").read_text())
    raw["hidden_act"] = "gelu"
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ExportError, match=f"^{out / 'config.json'}: hidden_act is 'gelu'"):
        load_exported_draft(out, embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight)


@pytest.mark.parametrize("arch", ["Qwen3DSparkModel", "LingDSparkModel"])
def test_draftforges_own_exports_still_load_for_each_architecture(tmp_path, arch):
    model = tiny_draft()
    out = export_draft(model, tmp_path / "export", arch=arch, progress=_quiet)
    raw = json.loads((out / "config.json").read_text())
    assert (raw["architectures"], raw["hidden_act"], raw["attention_bias"]) == ([arch], "silu", False)
    loaded = load_exported_draft(out, embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight)
    assert loaded.config == model.config
    # an absent key is the Qwen3 default (silu, no biases); an absent architectures is left to the server
    for key in ("hidden_act", "attention_bias", "architectures"):
        del raw[key]
    assert config_from_serving(raw) == model.config
    assert config_from_serving(dict(raw, architectures=None)) == model.config


# ----------------------------------------------------------------------------- one embedding copy


@pytest.mark.parametrize("kept", ["embed_tokens.weight", "lm_head.weight"])
def test_an_export_holding_one_embedding_copy_loads_the_other_from_the_target(tmp_path, kept, capsys):
    """The contract makes each copy optional; one alone used to be refused as an unexpected tensor."""
    model = tiny_draft()
    out = export_draft(model, tmp_path / "export", with_embeddings=True, progress=_quiet)
    state = load_file(str(out / "model.safetensors"))
    dropped = "lm_head.weight" if kept == "embed_tokens.weight" else "embed_tokens.weight"
    del state[dropped]
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    with pytest.raises(ExportError) as err:
        load_exported_draft(out)
    assert str(err.value) == (f"{out} holds only {kept}, not {dropped}; pass the target (or its "
                              "embedding and lm_head) to load it")

    # the target's matrices for both, as servers attach them (since 2026-12-06: the folder's
    # own copy of the one it holds won before), and a note that the held copy is not the target's
    other = tiny_draft(seed=9)
    capsys.readouterr()
    loaded = load_exported_draft(out, embed_tokens=other.embed_tokens.weight, lm_head=other.lm_head.weight)
    weights = loaded.state_dict()
    assert torch.equal(weights[kept], other.state_dict()[kept])
    assert torch.equal(weights[dropped], other.state_dict()[dropped])
    assert capsys.readouterr().err == (f"draftforge: note: {out}'s {kept} differ from the target's; "
                                       "using the target's, as servers do\n")
    # the folder's own copy where nothing is given for it
    given = {"embed_tokens" if dropped == "embed_tokens.weight" else "lm_head": other.state_dict()[dropped]}
    alone = load_exported_draft(out, **given).state_dict()
    assert torch.equal(alone[kept], model.state_dict()[kept])
    same = load_exported_draft(out, embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight)
    assert capsys.readouterr().err == ""  # the held copy is the target's: nothing to say
    for want, got in zip(_outputs(model), _outputs(same), strict=True):
        assert torch.equal(want, got)


def test_a_wrong_shaped_single_embedding_copy_is_still_refused(tmp_path):
    model = tiny_draft()
    out = export_draft(model, tmp_path / "export", with_embeddings=True, progress=_quiet)
    state = load_file(str(out / "model.safetensors"))
    del state["lm_head.weight"]
    state["embed_tokens.weight"] = torch.zeros(64, 16)
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match=r"wrong shapes: embed_tokens\.weight: \(64, 16\)"):
        load_exported_draft(out, embed_tokens=model.embed_tokens.weight, lm_head=model.lm_head.weight)


# ----------------------------------------------------------------------------- key table before dtypes


def test_a_stray_tensor_of_another_dtype_is_reported_as_unexpected_not_mixed_dtypes(tmp_path):
    model = tiny_draft()
    state = {**model.state_dict(), "stray.weight": torch.zeros(2, dtype=torch.bfloat16)}
    with pytest.raises(ExportError, match=r"unexpected tensors: stray\.weight") as err:
        export_draft((state, model.config), tmp_path / "export", progress=_quiet)
    assert "mixed dtypes" not in str(err.value)
    assert not (tmp_path / "export").exists()
    # a draft that really mixes dtypes is still told so
    state = {**model.state_dict(), "fc.weight": model.fc.weight.to(torch.bfloat16)}
    with pytest.raises(ExportError, match="mixed dtypes"):
        export_draft((state, model.config), tmp_path / "export", progress=_quiet)


# ----------------------------------------------------------------------------- llama.cpp conversion


def test_two_conversions_into_one_work_folder_do_not_share_a_temporary_file(tmp_path, monkeypatch):
    """A second check converting into the same --work-dir while the first converts: each used
    ``.draft-f32.gguf.tmp``, so the second overwrote the first's file and deleted it on finishing,
    and the first failed renaming a file that was gone."""
    work = tmp_path / "work"
    out = work / "draft-f32.gguf"
    outfiles = []

    def converter(command, **kwargs):
        outfile = Path(command[command.index("--outfile") + 1])
        outfiles.append(outfile)
        if len(outfiles) > 1:
            outfile.write_bytes(b"GGUF second")
            return subprocess.CompletedProcess(command, 0, "", "")
        outfile.write_bytes(b"GGUF first, half")
        # the other check converts meanwhile, and finishes first
        assert llamacpp.convert(tmp_path, tmp_path / "other", out) == out
        assert out.read_bytes() == b"GGUF second"
        assert outfile.read_bytes() == b"GGUF first, half"  # not taken, overwritten or deleted
        with outfile.open("ab") as half:
            half.write(b", finished")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", converter)
    assert llamacpp.convert(tmp_path, tmp_path / "export", out) == out
    assert out.read_bytes() == b"GGUF first, half, finished"
    assert outfiles[0] != outfiles[1] and all(f.parent.parent == work for f in outfiles)
    assert [p.name for p in work.iterdir()] == ["draft-f32.gguf"]  # no temporary left behind


# ----------------------------------------------------------------------------- offline pushes


@pytest.mark.parametrize(
    "env, named",
    [
        ({"HF_HUB_OFFLINE": "true"}, "HF_HUB_OFFLINE=true"),
        ({"HF_HUB_OFFLINE": "YES"}, "HF_HUB_OFFLINE=YES"),
        ({"HF_HUB_OFFLINE": "On"}, "HF_HUB_OFFLINE=On"),
        ({"TRANSFORMERS_OFFLINE": "1"}, "TRANSFORMERS_OFFLINE=1"),
        ({"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "true"}, "TRANSFORMERS_OFFLINE=true"),
    ],
)
def test_a_push_offline_by_any_spelling_huggingface_hub_accepts_fails_clearly_up_front(tmp_path, monkeypatch,
                                                                                      env, named):
    """Only HF_HUB_OFFLINE=1 got the clear message; ``true`` made the push reach the client,
    which refused with its OfflineModeIsEnabled, reported as a failed push to check the network."""
    from huggingface_hub import constants

    from draftforge.train.export import push_to_hub

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # what huggingface_hub computes from these at import (the suite imported it with HF_HUB_OFFLINE=1)
    offline = constants._is_true(env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE"))
    assert offline
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    with pytest.raises(RuntimeError) as err:
        push_to_hub(tmp_path, "me/draft")
    variable = named.split("=")[0]
    assert str(err.value) == (
        f"cannot push to me/draft: {named} is set, so huggingface_hub is offline. The export is "
        f"complete at {tmp_path}; unset {variable} and run `draftforge export ... --push-to-hub` "
        "again, or upload with `huggingface-cli upload`"
    )


@pytest.mark.parametrize("value", ["0", "false", "no"])
def test_offline_values_huggingface_hub_reads_as_false_are_not_offline(monkeypatch, value):
    from huggingface_hub import constants

    from draftforge.train.export import hub_offline_setting

    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")  # not read: HF_HUB_OFFLINE is set
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants._is_true(value))
    assert hub_offline_setting() is None


@pytest.mark.parametrize("argv", [["/nonexistent/run"], ["."]])
def test_an_export_error_names_the_command_once(argv, capsys, tmp_path, monkeypatch):
    """'draftforge export: error: draftforge export: ... does not exist': the CLI adds the
    prefix, the message added it again."""
    from draftforge.cli import main

    monkeypatch.chdir(tmp_path)  # "." : no recipe, no run to derive --out from
    assert main(["export", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("draftforge export: error: ") and err.count("draftforge export") == 1, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_target_on_a_gpu_replaces_the_folders_cpu_copies(tmp_path, capsys):
    """The folder's copies are read onto the CPU and a target's matrices may sit on a GPU:
    comparing the two must not fail on the devices (draftforge eval loads so on a GPU)."""
    model = tiny_draft()
    out = export_draft(model, tmp_path / "export", with_embeddings=True, progress=_quiet)
    loaded = load_exported_draft(out, embed_tokens=model.embed_tokens.weight.cuda(),
                                 lm_head=model.lm_head.weight.cuda(), device="cuda")
    assert capsys.readouterr().err == ""  # the same matrices: nothing to note
    for want, got in zip(model.state_dict().values(), loaded.state_dict().values(), strict=True):
        assert torch.equal(want, got.cpu())
