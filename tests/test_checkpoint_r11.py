"""Checkpoint review, round 11: what a resume refuses and how it names the file.

In one process: FSDP2's ``dcp/`` folder is written and read by torch.distributed.checkpoint
without a process group (the layout, checks and messages are those of a sharded run).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from splitserve_helpers import tiny_recipe
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.cli import main as draftforge_main
from draftforge.config import load_recipe
from draftforge.train import checkpoint as ckpt
from draftforge.train.model import DSparkConfig
from draftforge.train.sample import pack
from draftforge.train.trainer import Trainer


def _trainer(run_dir: Path, **overrides) -> Trainer:
    return Trainer(model_config=tiny_model_config(num_hidden_layers=1),
                   train=train_config(str(run_dir), **overrides), embeddings=target_embeddings(),
                   run_dir=run_dir, recipe_yaml="name: r11\n")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A run directory with complete checkpoints at steps 2 and 4 (copied by each test)."""
    run = tmp_path_factory.mktemp("saved") / "run"
    _trainer(run, steps=4, checkpoint_interval=2).fit(pack(chain_samples(30), 90))
    return run


@pytest.fixture()
def run(saved_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(saved_run, copy)
    return copy


# -- fsdp2: a truncated or missing DCP data file is named --------------------------------


def _fsdp2_checkpoint(run_dir: Path):
    """An fsdp2-layout checkpoint of a small AdamW-trained module (one process, no group):
    its path, the module and its optimizer."""
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4, generator=gen)).sum().backward()
    optimizer.step()
    state = {"step": 2, "skipped_steps": 0, "strategy": "fsdp2", "consumed_ids": [["a"]]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        path = ckpt.save_checkpoint(run_dir=run_dir, step=2, strategy="fsdp2", model=model,
                                    optimizer=optimizer, engine=None, state=state, group=None,
                                    keep_last=2)
    return path, model, optimizer


def _load_fsdp2(path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt.load_checkpoint(path=path, strategy="fsdp2", model=model, optimizer=optimizer,
                             engine=None, group=None)
    return model, optimizer


def test_a_whole_dcp_checkpoint_loads(tmp_path):
    path, model, _ = _fsdp2_checkpoint(tmp_path)
    assert ckpt.read_checked_state(path)["step"] == 2
    assert torch.equal(_load_fsdp2(path)[0].weight, model.weight)


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_truncated_or_missing_dcp_data_file_is_named_before_loading(tmp_path, damage):
    """DCP reported a cut .distcp file as 'CheckpointException ranks:dict_keys([0])' and the
    message named only the dcp folder; rank 0's file check (read_checked_state, which the
    launcher runs before any rank starts) passed it."""
    path, _, _ = _fsdp2_checkpoint(tmp_path)
    data = sorted((path / "dcp").glob("*.distcp"))
    assert len(data) == 1
    if damage == "truncate":
        data[0].write_bytes(data[0].read_bytes()[:100])
    else:
        data[0].unlink()
    expected = f"checkpoint file {data[0]} is corrupt or truncated"
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.read_checked_state(path)
    assert expected in str(info.value) and f"delete the folder {path}" in str(info.value)
    with pytest.raises(ckpt.CheckpointError) as info:
        _load_fsdp2(path)
    assert expected in str(info.value)


# -- train.resume naming a file or a run directory ---------------------------------------


def test_a_resume_path_that_is_a_file_says_so_and_names_its_checkpoint(run, tmp_path):
    """It said 'checkpoint folder .../model.safetensors does not exist' of a file that exists."""
    newest = run / "checkpoints" / "step_00000004"
    with pytest.raises(ckpt.CheckpointError) as info:
        _trainer(tmp_path / "branch", resume=str(newest / "model.safetensors")).resume()
    assert str(info.value) == (f"train.resume: {newest / 'model.safetensors'} is a file, not a "
                               f"checkpoint folder; name its checkpoint folder, {newest}")
    stray = tmp_path / "notes.txt"
    stray.write_text("x")
    with pytest.raises(ckpt.CheckpointError, match=r"notes.txt is a file, not a checkpoint folder$"):
        _trainer(tmp_path / "branch", resume=str(stray)).resume()
    # following the advice works
    assert _trainer(tmp_path / "branch", resume=str(newest)).resume().step == 4


def test_a_resume_path_that_is_a_run_directory_names_its_newest_checkpoint(run, tmp_path):
    with pytest.raises(ckpt.CheckpointError) as info:
        _trainer(tmp_path / "branch", resume=str(run)).resume()
    assert str(info.value) == (
        f"train.resume: {run} is a run directory, not a checkpoint: name one of its checkpoints "
        f"(its newest complete one is {run / 'checkpoints' / 'step_00000004'}), or set "
        f"train.output_dir={run} with train.resume=auto")
    for folder in (run / "checkpoints").iterdir():
        (folder / ckpt.COMPLETE).unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"\(it holds no complete one\)"):
        _trainer(tmp_path / "branch", resume=str(run)).resume()


# -- trainer_state.json that parses but lacks what a resume reads ------------------------


@pytest.mark.parametrize("edit, problem", [
    (lambda s: s.pop("skipped_steps"), "no integer 'skipped_steps' field"),  # was KeyError
    # was "written by 3 trainer rank(s); this run has 1"
    (lambda s: s.update(consumed_ids="abc"), "'consumed_ids' is not a list of sample-id lists"),
    (lambda s: s.update(extra_per_rank=[]), "'extra_per_rank' is not a list of objects, one per "
                                            "trainer rank (1)"),  # was IndexError
    (lambda s: s.update(schedule=[1]), "'schedule' is not an object"),  # was AttributeError
])
def test_a_trainer_state_missing_what_resume_reads_is_named(run, edit, problem):
    newest = run / "checkpoints" / "step_00000004"
    state_file = newest / ckpt.STATE_FILE
    state = json.loads(state_file.read_text())
    edit(state)
    state_file.write_text(json.dumps(state))
    with pytest.raises(ckpt.CheckpointError) as info:
        _trainer(run, steps=6, resume="auto").resume()
    message = str(info.value)
    assert f"checkpoint file {state_file} is corrupt or truncated (ValueError: {problem}" in message
    assert f"delete the folder {newest}" in message


def test_a_trainer_state_of_an_older_checkpoint_still_resumes(run):
    """dropped_ids, extra_per_rank and the schedule's settings came later: their absence is fine."""
    state_file = run / "checkpoints" / "step_00000004" / ckpt.STATE_FILE
    state = json.loads(state_file.read_text())
    for key in ("dropped_ids", "extra_per_rank", "schedule"):
        del state[key]
    state_file.write_text(json.dumps(state))
    info = _trainer(run, steps=6, resume="auto").resume()
    assert info.step == 4 and info.extra == {} and info.schedule_change == ""


# -- the RNG state of each trainer rank ----------------------------------------------------


def test_resume_restores_the_saved_rng_state(run):
    from safetensors.torch import load_file

    saved = load_file(str(run / "checkpoints" / "step_00000004" / "rng" / "rank_0.safetensors"))["cpu"]
    torch.manual_seed(999)
    assert not torch.equal(torch.get_rng_state(), saved)
    assert _trainer(run, steps=6, resume="auto").resume().step == 4
    assert torch.equal(torch.get_rng_state(), saved)


def test_a_checkpoint_without_its_rng_file_is_incomplete_not_resumed_silently(run):
    """A missing rng/rank_R.safetensors was skipped: the resume went on with another RNG state."""
    newest = run / "checkpoints" / "step_00000004"
    (newest / "rng" / "rank_0.safetensors").unlink()
    with pytest.raises(ckpt.CheckpointError) as info:
        _trainer(run, steps=6, resume="auto").resume()
    assert str(info.value) == (f"checkpoint {newest} has no rng/rank_0.safetensors; it is incomplete: "
                               "delete it to resume from the previous complete checkpoint")
    shutil.rmtree(newest)  # following the advice works
    assert _trainer(run, steps=6, resume="auto").resume().step == 2


# -- another trainer count or strategy: refused before any rank starts -------------------


def _recipe_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny recipe and a complete checkpoint of its draft where its resume looks."""
    from draftforge.splitserve.launch import _model_config

    recipe = tiny_recipe(tmp_path)
    cfg = load_recipe(recipe)
    config = DSparkConfig(**_model_config(cfg))
    gen = torch.Generator().manual_seed(0)
    shape = (config.vocab_size, config.target_hidden_size)
    trainer = Trainer(model_config=config, train=cfg.train, run_dir=Path(cfg.train.output_dir),
                      embeddings=(torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)))
    return recipe, trainer.save()


def _dry_run(recipe: Path, capsys) -> tuple[int, str]:
    try:
        code = draftforge_main(["train", str(recipe), "--dry-run"])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_train_refuses_a_checkpoint_of_another_trainer_count_or_strategy_before_starting(tmp_path, capsys):
    """The launcher's check passed them; the trainer ranks refused them only after the target
    ranks had loaded the target and sent its embeddings."""
    recipe, path = _recipe_checkpoint(tmp_path)
    assert _dry_run(recipe, capsys)[0] == 0  # as written: accepted
    state_file = path / ckpt.STATE_FILE
    state = json.loads(state_file.read_text())
    shutil.copy(path / "rng" / "rank_0.safetensors", path / "rng" / "rank_1.safetensors")
    state_file.write_text(json.dumps(dict(state, consumed_ids=[[], []], consumed_tokens=[[], []], dropped_ids=[[], []],
                                          extra_per_rank=[{}, {}])))
    code, err = _dry_run(recipe, capsys)
    assert code == 2
    assert (f"checkpoint {path} was written by 2 trainer rank(s); this run has 1. Resume with the "
            "same number of trainer ranks.") in err
    state_file.write_text(json.dumps(dict(state, strategy="fsdp2")))
    code, err = _dry_run(recipe, capsys)
    assert code == 2
    assert f"checkpoint {path} was written with train.strategy='fsdp2', this run uses 'single'" in err


def test_a_resume_with_another_seed_says_the_run_no_longer_repeats(run, capsys):
    """train.seed draws every step's anchors: a resume under another one is told, like a changed
    schedule or AdamW setting; under the same seed nothing is said."""
    _trainer(run, steps=6, resume="auto").resume()
    assert "train.seed" not in capsys.readouterr().out
    _trainer(run, steps=6, resume="auto", seed=1).resume()  # the saved run's seed is 3
    assert ("[trainer] note: train.seed 3 -> 1: the steps from 5 on draw their anchors from the new "
            "seed") in capsys.readouterr().out
