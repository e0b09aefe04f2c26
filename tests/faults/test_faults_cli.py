"""Malformed input through the ``draftforge`` command: exit status 2 and a message naming the file.

Everything here fails before any process group starts (``draftforge train``
checks the recipe, the data and the checkpoint it would resume before torchrun),
so each case runs in-process in well under a second. ``--dry-run`` guards every
train call: a case that wrongly passed would print a dry run, never start a job.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from splitserve_helpers import tiny_recipe
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.cli import main
from draftforge.config import load_recipe
from draftforge.train.checkpoint import is_complete
from draftforge.train.export import export_draft
from draftforge.train.model import DSparkConfig, DSparkDraft
from draftforge.train.sample import pack
from draftforge.train.trainer import Trainer


def _run(argv: list[str], capsys) -> tuple[int, str]:
    """Exit status and stderr of ``draftforge ARGV`` (argparse's own exits included)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def _train(recipe: Path, capsys, *overrides: str) -> tuple[int, str]:
    return _run(["train", recipe, *overrides, "--dry-run"], capsys)


# --------------------------------------------------------------------------- recipes


def test_truncated_recipe(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("train: {steps: 3, lr: [1e-3\n")  # cut off mid-line
    code, err = _train(recipe, capsys)
    assert code == 2
    assert f"{recipe}:2: YAML syntax error" in err


def test_binary_recipe(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(b"\xff\xfe\x00\x89PNG garbage")
    code, err = _train(recipe, capsys)
    assert code == 2 and f"{recipe}:1: not UTF-8 text: byte 0xff at column 1" in err and "save the recipe as UTF-8" in err


def test_recipe_that_is_a_list(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("- train\n- draft\n")
    code, err = _train(recipe, capsys)
    assert code == 2 and "the top level must be a mapping of sections" in err


def test_restart_target_needs_resume_auto(tmp_path, capsys):
    recipe = tiny_recipe(tmp_path, overrides={"split.restart_target": True, "train.resume": "never"})
    code, err = _train(recipe, capsys)
    assert code == 2
    assert "split.restart_target: a restarted job continues from the newest checkpoint" in err
    assert "needs train.resume: auto (it is 'never')" in err


# --------------------------------------------------------------------------- command lines


@pytest.mark.parametrize("argv, expected", [
    (["train"], "the following arguments are required: RECIPE"),
    (["frobnicate"], "unknown command 'frobnicate'"),
    (["config", "shwo", "x.yaml"], "unknown subcommand 'shwo' of 'config'"),
    (["config"], "a subcommand is needed after 'config'"),
    (["train", "RECIPE", "--nproc", "two"], "argument --nproc: invalid int value: 'two'"),
    (["train", "RECIPE", "train.steps"], "command line 'train.steps': expected key.sub=value"),
    (["eval", "RUN", "--target", "random"], "--target random: model 'random' needs a declared 'shape' section"),
    (["train", "RECIPE", "train.steps=-3"], "train.steps: must be greater than 0, got int -3"),
    (["export", "RUN", "--arch", "GPT2"], "argument --arch: invalid choice: 'GPT2'"),
    (["train", "RECIPE", "--master-addr"], "argument --master-addr: expected one argument"),
    # a dry run refuses what the run itself would
    (["train", "RECIPE", "--dry-run", "--max-restarts", "-1"], "argument --max-restarts: must be 0 or more, got -1"),
    (["train", "RECIPE", "--dry-run", "--node-rank", "3"], "--node-rank 3: the recipe runs on one node (split.num_nodes 1); drop --node-rank or set split.num_nodes"),
    (["train", "RECIPE", "--dry-run", "--master-port", "99999"], "argument --master-port: must be a TCP port, 1..65535"),
    (["export", "nowhere/at/all"], "nowhere/at/all does not exist; give a run directory"),
    (["bench", "train", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["bench", "target", "--batch-sizes", "8,0"], "argument --batch-sizes: must be at least 1, got 0"),
    (["bench", "target", "--dtypes", "float16"], "argument --dtypes: unknown 'float16'; valid: bfloat16, float32"),
    (["bench", "objective", "--hidden", "100"], "argument --hidden: must be a multiple of 128 (the head width), got 100"),
    (["bench", "objective", "--paths", "foo"], "argument --paths: unknown 'foo'; valid: chunked, unchunked"),
    (["export", "RUN", "--max-shard-size-mb", "-5"], "argument --max-shard-size-mb: must be greater than 0"),
    (["export", "RUN", "--eval-report", "nope.md"], "--eval-report nope.md: no such file"),
    (["eval", "llamacpp", "RUN"], "the following arguments are required: --recipe"),
    (["eval", "llamacpp", "RUN", "--recipe", "RECIPE"], "not an export folder (no config.json)"),
    (["eval", "llamacpp", "RUN", "--recipe", "RECIPE", "--p-min", "2"], "argument --p-min: must lie in [0, 1], got 2"),
])
def test_bad_command_lines(tmp_path, capsys, argv, expected):
    recipe = tiny_recipe(tmp_path)
    argv = [str(recipe) if a == "RECIPE" else str(tmp_path) if a == "RUN" else a for a in argv]
    code, err = _run(argv, capsys)
    assert code == 2 and expected in err, err


# --------------------------------------------------------------------------- datasets


def test_truncated_jsonl(tmp_path, capsys):
    recipe = tiny_recipe(tmp_path)
    data = tmp_path / "convs.jsonl"
    text = data.read_text()
    data.write_text(text[: len(text) - 40])  # the last line cut mid-object
    lines = data.read_text().count("\n") + 1
    code, err = _train(recipe, capsys)
    assert code == 2
    assert f"{data}, line {lines}: invalid JSON" in err


def test_truncated_gzip_jsonl(tmp_path, capsys):
    recipe = tiny_recipe(tmp_path)
    plain = tmp_path / "convs.jsonl"
    packed = tmp_path / "convs.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes())[:200])
    code, err = _train(recipe, capsys, f"data.train_files=[{packed}]")
    assert code == 2 and f"{packed}: cannot be read" in err


def test_truncated_parquet(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    recipe = tiny_recipe(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "convs.jsonl").read_text().splitlines()]
    table = tmp_path / "convs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), table)
    table.write_bytes(table.read_bytes()[:300])
    code, err = _train(recipe, capsys, f"data.train_files=[{table}]")
    assert code == 2 and f"{table}: not a readable parquet table" in err


def test_empty_data_file(tmp_path, capsys):
    recipe = tiny_recipe(tmp_path)
    (tmp_path / "convs.jsonl").write_text("")
    code, err = _train(recipe, capsys)
    assert code == 2 and "no conversations to train on" in err and "convs.jsonl" in err


def test_missing_data_file(tmp_path, capsys):
    recipe = tiny_recipe(tmp_path)
    (tmp_path / "convs.jsonl").unlink()
    code, err = _train(recipe, capsys)
    assert code == 2 and "data file not found" in err and "check data.train_files" in err


def test_row_without_messages(tmp_path, capsys):
    recipe = tiny_recipe(tmp_path)
    data = tmp_path / "convs.jsonl"
    data.write_text(data.read_text() + json.dumps({"id": "x", "text": "no turns"}) + "\n")
    code, err = _train(recipe, capsys)
    lines = data.read_text().count("\n")
    assert code == 2 and f"{data}, line {lines}" in err and "has no" in err


# --------------------------------------------------------------------------- checkpoints via train


def _checkpoint_for(recipe: Path) -> Path:
    """A complete checkpoint of the draft this recipe builds, written where resume looks."""
    from draftforge.splitserve.launch import _model_config

    cfg = load_recipe(recipe)
    model_config = DSparkConfig(**_model_config(cfg))
    gen = torch.Generator().manual_seed(0)
    shape = (model_config.vocab_size, model_config.target_hidden_size)
    trainer = Trainer(model_config=model_config, train=cfg.train,
                      embeddings=(torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)),
                      run_dir=Path(cfg.train.output_dir))
    return trainer.save()


def test_train_refuses_a_truncated_checkpoint_naming_the_file(tmp_path, capsys):
    recipe = tiny_recipe(tmp_path)
    path = _checkpoint_for(recipe)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    code, err = _train(recipe, capsys)
    assert code == 2
    assert f"checkpoint file {weights} is corrupt or truncated" in err
    assert f"delete the folder {path}" in err


def test_train_refuses_a_garbage_trainer_state(tmp_path, capsys):
    recipe = tiny_recipe(tmp_path)
    path = _checkpoint_for(recipe)
    (path / "trainer_state.json").write_text("\x00\x00")
    code, err = _train(recipe, capsys)
    assert code == 2 and "trainer_state.json is corrupt or truncated" in err


def test_train_refuses_to_resume_a_draft_of_another_block_size(tmp_path, capsys):
    recipe = tiny_recipe(tmp_path)
    _checkpoint_for(recipe)
    code, err = _train(recipe, capsys, "draft.block_size=8")
    assert code == 2
    assert "was written for a different draft" in err and "block_size: checkpoint 4, this recipe 8" in err


def test_train_refuses_a_resume_path_that_is_not_a_checkpoint(tmp_path, capsys):
    recipe = tiny_recipe(tmp_path)
    code, err = _train(recipe, capsys, f"train.resume={tmp_path}")
    assert code == 2 and f"train.resume: {tmp_path} is not a complete checkpoint" in err


def test_train_refuses_a_fresh_run_over_existing_checkpoints(tmp_path, capsys):
    recipe = tiny_recipe(tmp_path)
    path = _checkpoint_for(recipe)
    code, err = _train(recipe, capsys, "train.resume=never")
    assert code == 2
    assert f"already holds checkpoints ({path.name} in {path.parent}); a fresh run (train.resume=never)" in err
    assert is_complete(path), "the refusal leaves the existing checkpoint as it was"


# --------------------------------------------------------------------------- export and eval


@pytest.fixture()
def trained(tmp_path):
    """A run directory of a tiny draft (trainer_helpers), checkpoint at step 4."""
    run = tmp_path / "run"
    trainer = Trainer(model_config=tiny_model_config(), train=train_config(str(run), steps=4),
                      embeddings=target_embeddings(), run_dir=run)
    trainer.fit(pack(chain_samples(16), 90))
    return run


def test_export_of_a_truncated_checkpoint(trained, tmp_path, capsys):
    weights = trained / "checkpoints" / "step_00000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    code, err = _run(["export", trained, "--out", tmp_path / "out"], capsys)
    assert code == 2
    assert f"{weights}: not a readable safetensors file" in err and "truncated or corrupt" in err
    assert not (tmp_path / "out").exists()


def test_export_of_a_garbage_draft_config(trained, tmp_path, capsys):
    config = trained / "checkpoints" / "step_00000004" / "draft_config.json"
    config.write_text('{"vocab_size": 64')
    code, err = _run(["export", trained, "--out", tmp_path / "out"], capsys)
    assert code == 2 and f"{config}: not a valid draft config" in err


def test_export_of_a_run_without_complete_checkpoints(tmp_path, capsys):
    (tmp_path / "run" / "checkpoints" / "step_00000004.tmp").mkdir(parents=True)
    code, err = _run(["export", tmp_path / "run", "--out", tmp_path / "out"], capsys)
    assert code == 2 and "no complete checkpoint (step_* with a COMPLETE marker and trainer_state.json)" in err


def _export(tmp_path) -> Path:
    draft = DSparkDraft(tiny_model_config())
    draft.load_target_embeddings(*target_embeddings())
    return export_draft(draft, tmp_path / "export", progress=lambda *_: None)


def test_eval_of_an_export_with_a_corrupt_config(tmp_path, capsys):
    folder = _export(tmp_path)
    (folder / "config.json").write_text('{"architectures": ["Qwen3DSparkModel"],\n "vocab_size": ')
    code, err = _run(["eval", folder, "--recipe", tiny_recipe(tmp_path)], capsys)
    assert code == 2 and f"{folder / 'config.json'}:2: invalid JSON" in err


def test_loading_an_export_with_a_truncated_weights_file(tmp_path):
    """What ``draftforge eval`` calls once the target is loaded (an InputError: exit status 2)."""
    from draftforge.errors import InputError
    from draftforge.train.hf_load import load_exported_draft

    folder = _export(tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])
    with pytest.raises(InputError) as info:
        load_exported_draft(folder, embed_tokens=torch.zeros(64, 32), lm_head=torch.zeros(64, 32))
    assert f"{weights}: not a readable safetensors file" in str(info.value)


def test_loading_an_export_with_a_broken_shard_index(tmp_path):
    from draftforge.errors import InputError
    from draftforge.train.hf_load import read_safetensors_folder

    folder = _export(tmp_path)
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(InputError, match=r"model.safetensors.index.json: not a valid safetensors index \(KeyError"):
        read_safetensors_folder(folder)


def test_eval_refuses_a_draft_that_does_not_fit_the_target(tmp_path, capsys):
    folder = _export(tmp_path)  # hidden 32, vocabulary 64, 6 target layers, reads layers [0, 2, 4]
    recipe = tiny_recipe(tmp_path)  # random target: hidden 64, vocabulary 8192, 4 layers
    code, err = _run(["eval", folder, "--recipe", recipe], capsys)
    assert code == 2
    assert f"the draft {folder} does not fit the target random" in err
    assert "hidden size: the draft reads target features of size 32, the target's hidden_size is 64" in err
    assert "vocabulary: the draft has 64 tokens, the target 8192" in err
    assert "layer ids: the draft reads target layers [0, 2, 4], but [4] do not exist" in err
    assert "num_target_layers: the draft was trained on a target of 6 layers, this target has 4" in err


def test_eval_of_a_folder_that_holds_no_draft(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, err = _run(["eval", tmp_path / "empty", "--recipe", tiny_recipe(tmp_path)], capsys)
    assert code == 2 and "no model.safetensors found" in err


def test_export_on_a_full_disk_leaves_no_partial_folder(trained, tmp_path, capsys, monkeypatch):
    """Sharded export whose second shard hits ENOSPC (tests/test_export.py::
    test_failed_export_leaves_no_folder_and_keeps_an_older_export covers the library call)."""
    import errno
    import os

    import safetensors.torch

    real = safetensors.torch.save_file
    calls = {"n": 0}

    def save_file(tensors, filename, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            Path(filename).write_bytes(b"\x00" * 16)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    out = tmp_path / "exports" / "draft"
    code, err = _run(["export", trained, "--out", out, "--max-shard-size-mb", "0.01"], capsys)
    assert code == 2
    assert f"writing the export to {out} failed" in err and "No space left on device" in err
    assert "no partial folder was left" in err
    assert calls["n"] == 2 and not out.exists()
    # no temporary folder either, nor the folder above --out the export made for it
    assert not (tmp_path / "exports").exists()
