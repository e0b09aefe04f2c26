"""`train.init_from`: a run's draft starts from an exported folder's weights, for further
training. Issue 5 asks that an export load back "for evaluation and further training", and the
README said draftforge's loader served "further training from an export"; no recipe could ask
for it (review round 61)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.config import load_recipe
from draftforge.errors import InputError
from draftforge.recipe_errors import RecipeError
from draftforge.train.export import EMBEDDING_KEYS, export_draft
from draftforge.train.init_from import init_from_export
from draftforge.train.model import DSparkDraft
from draftforge.train.trainer import Trainer


def _export(folder: Path, *, seed: int = 11, **config) -> Path:
    """A draft of the trainer helpers' shapes (``config`` overriding them), its weights drawn
    with ``seed`` (not the trainer helpers' 3), exported as ``draftforge export`` writes it."""
    draft = DSparkDraft(tiny_model_config(**config))
    draft.init_weights(seed=seed)
    draft.load_target_embeddings(*target_embeddings())
    return export_draft(draft, folder, progress=lambda _: None)


def _trainer(run: Path, export: Path | None = None, **model) -> Trainer:
    init = None if export is None else (lambda m: init_from_export(m, str(export)))
    return Trainer(model_config=tiny_model_config(**model), train=train_config(str(run), steps=1, dtype="float32"),
                   embeddings=target_embeddings(), run_dir=run, init_draft=init)


def test_the_draft_starts_as_the_export_and_trains_from_there(tmp_path):
    export = _export(tmp_path / "export")
    written = load_file(str(export / "model.safetensors"))  # read independently of the loader
    assert not set(written) & set(EMBEDDING_KEYS)  # exported without them: the target's are used
    trainer = _trainer(tmp_path / "run", export)
    state = trainer.full_state_dict()
    fresh = _trainer(tmp_path / "fresh").full_state_dict()
    assert set(written) == set(state) - set(EMBEDDING_KEYS)
    for name, tensor in written.items():
        assert torch.equal(state[name], tensor.to(state[name].dtype)), name
    assert any(not torch.equal(fresh[name], state[name]) for name in written)  # not the seed's start
    embed, lm_head = target_embeddings()
    assert torch.equal(state["embed_tokens.weight"], embed) and torch.equal(state["lm_head.weight"], lm_head)
    trainer.fit([[sample] for sample in chain_samples(2)])
    assert trainer.step == 1
    moved = trainer.full_state_dict()
    assert any(not torch.equal(moved[name], state[name]) for name in written)


def test_a_draft_without_a_confidence_head_continues_from_its_export(tmp_path):
    """The recipe's confidence_head_with_markov (default true) means nothing without a head, and
    the export writes it false: not a difference (review round 61)."""
    export = _export(tmp_path / "export", enable_confidence_head=False, confidence_head_with_markov=True)
    assert json.loads((export / "config.json").read_text())["confidence_head_with_markov"] is False
    written = load_file(str(export / "model.safetensors"))
    state = _trainer(tmp_path / "run", export, enable_confidence_head=False,
                     confidence_head_with_markov=True).full_state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in written.items())


def test_target_layers_listed_out_of_order_load_back_in_the_recipes_order(tmp_path):
    """The export lists the layers ascending with fc's column blocks permuted to match; loading
    into the recipe's order puts them back: the draft's fc is the exported draft's own."""
    draft = DSparkDraft(tiny_model_config(target_layer_ids=[4, 0, 2]))
    draft.init_weights(seed=11)
    draft.load_target_embeddings(*target_embeddings())
    export = export_draft(draft, tmp_path / "export", progress=lambda _: None)
    assert json.loads((export / "config.json").read_text())["target_layer_ids"] == [0, 2, 4]
    written = load_file(str(export / "model.safetensors"))
    assert not torch.equal(written["fc.weight"], draft.fc.weight.detach())  # permuted on the way out
    state = _trainer(tmp_path / "run", export, target_layer_ids=[4, 0, 2]).full_state_dict()
    for name, tensor in draft.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_a_config_without_the_confidence_flag_is_judged_by_its_weights(tmp_path):
    """Another tool's export whose config.json leaves out enable_confidence_head (SGLang takes
    it as true) and holds no head: eval's clear refusal, not a field comparison that would
    advise turning the recipe's head on."""
    export = _export(tmp_path / "export", enable_confidence_head=False)
    config = json.loads((export / "config.json").read_text())
    del config["enable_confidence_head"]
    (export / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=r"has no enable_confidence_head, which SGLang takes as true"):
        _trainer(tmp_path / "run", export, enable_confidence_head=False)


def test_an_export_of_another_draft_is_refused_naming_what_differs(tmp_path):
    export = _export(tmp_path / "export", num_hidden_layers=1, block_size=6)
    with pytest.raises(InputError) as err:
        _trainer(tmp_path / "run", export)
    assert str(err.value) == (
        f"train.init_from {export} holds another draft than the recipe's draft section builds: "
        "num_hidden_layers 1 (the recipe's draft: 2); block_size 6 (the recipe's draft: 4). Set the draft "
        "section to the export's values (its config.json), or start from another export")


def test_a_folder_that_is_not_an_export_is_refused(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"")
    with pytest.raises(InputError, match=r"train.init_from .*/checkpoint: no config.json there, so it is not an "
                       r"exported draft; .*continued with train.resume"):
        _trainer(tmp_path / "run", checkpoint)


def test_a_damaged_export_is_refused_as_eval_refuses_it(tmp_path):
    export = _export(tmp_path / "export")
    tensors = load_file(str(export / "model.safetensors"))
    name = next(n for n in sorted(tensors) if n.startswith("layers.") and n.endswith("proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(export / "model.safetensors"))
    with pytest.raises(InputError, match=rf"^train.init_from {export}: {export}: {name} holds NaN or infinite"):
        _trainer(tmp_path / "run", export)


def test_a_bigram_start_with_an_export_is_refused_by_the_recipe_checks():
    with pytest.raises(RecipeError, match="bigram would replace the Markov head that train.init_from loads"):
        load_recipe("recipes/smollm2-cpu.yaml", ["train.init_from=/somewhere/export", "train.markov_init=bigram"])
    assert load_recipe("recipes/smollm2-cpu.yaml", ["train.init_from=~/export"]).train.init_from == str(
        Path.home() / "export")


def test_draftforge_train_continues_an_exported_draft(tmp_path):
    """The whole path: train, export, then a second run started from the export (it says so);
    one whose draft section differs is refused with exit status 2 before any rank starts."""
    from splitserve_helpers import tiny_recipe

    recipe = tiny_recipe(tmp_path, steps=2)

    def draftforge(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "draftforge", *args], capture_output=True, text=True,
                              timeout=600)

    first = draftforge("train", str(recipe))
    assert first.returncode == 0, first.stderr[-3000:]
    export = tmp_path / "export"
    done = draftforge("export", str(tmp_path / "run"), "--out", str(export))
    assert done.returncode == 0, done.stderr[-3000:]
    again = draftforge("train", str(recipe), f"train.init_from={export}", f"train.output_dir={tmp_path / 'again'}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"[trainer] draft weights from {export} (" in again.stdout + again.stderr
    # two FSDP2 trainer ranks, one step at a negligible rate: the run's weights are the export's
    fsdp = draftforge("train", str(recipe), f"train.init_from={export}", f"train.output_dir={tmp_path / 'fsdp'}",
                      "train.strategy=fsdp2", "split.trainer_ranks=[1,2]", "train.steps=1", "train.lr=1e-9",
                      "split.max_epochs=null")
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    done = draftforge("export", str(tmp_path / "fsdp"), "--out", str(tmp_path / "fsdp-export"))
    assert done.returncode == 0, done.stderr[-3000:]
    source, trained = (load_file(str(folder / "model.safetensors")) for folder in (export, tmp_path / "fsdp-export"))
    assert set(source) == set(trained)
    for name, tensor in source.items():
        assert torch.allclose(trained[name].float(), tensor.float(), rtol=1e-2, atol=1e-4), name
    other = draftforge("train", str(recipe), f"train.init_from={export}", "draft.num_hidden_layers=2",
                       f"train.output_dir={tmp_path / 'other'}")
    assert other.returncode == 2, other.stderr[-3000:]
    assert "num_hidden_layers 1 (the recipe's draft: 2)" in other.stderr
    assert "[rank" not in other.stdout + other.stderr


def test_the_demo_refuses_a_recipe_that_starts_from_an_export(tmp_path, capsys):
    from splitserve_helpers import tiny_recipe

    from draftforge.cli import main

    recipe = tiny_recipe(tmp_path, overrides={"train.init_from": str(tmp_path / "export")})
    assert main(["demo", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert (f"{recipe}: train.init_from {tmp_path / 'export'}: the demo compares DSpark with the DFlash "
            "ablation trained from scratch on the same budget") in err
    assert not (tmp_path / "run").exists()


def test_a_node_running_no_trainer_rank_does_not_read_the_export(tmp_path):
    """Target ranks never load the draft: a target-only node of a multi-node job need not hold
    the export (its trainers' node checks it)."""
    from splitserve_helpers import tiny_recipe

    from draftforge.splitserve.launch import preflight

    cfg = load_recipe(tiny_recipe(tmp_path, overrides={"train.init_from": str(tmp_path / "elsewhere")}))
    preflight(cfg, loads_draft=False)
    with pytest.raises(InputError, match="no config.json there"):
        preflight(cfg)
