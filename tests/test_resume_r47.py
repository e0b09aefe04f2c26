"""A resume names the recipe settings it changes from the checkpointed run's (a review of
checkpointing and resume, 2026-12-06): train.grad_accum, split.token_budget and the like were
accepted without a word, while a changed seed or schedule was noted."""

from __future__ import annotations

from pathlib import Path

import pytest
from splitserve_helpers import tiny_recipe
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.config import load_recipe
from draftforge.train import checkpoint as ckpt
from draftforge.train.recipe_changes import recipe_changes, resume_note
from draftforge.train.sample import pack
from draftforge.train.trainer import Trainer


def _resolved(recipe: Path, *overrides: str) -> str:
    return load_recipe(recipe, list(overrides)).to_yaml()


def test_result_changing_settings_are_named_with_both_values_and_the_rest_is_not(tmp_path):
    recipe = tiny_recipe(tmp_path)
    saved = _resolved(recipe)
    assert recipe_changes(saved, saved) == []
    # where the run writes and logs, the evaluation, and what the trainer notes itself: silent
    quiet = _resolved(recipe, "train.log_interval=7", "train.keep_last=5", "eval.num_prompts=2",
                      "export.max_shard_size_mb=10", "train.seed=11", "train.lr=0.5",
                      "split.peer_timeout_s=99", f"train.output_dir={tmp_path / 'elsewhere'}")
    assert recipe_changes(saved, quiet) == []
    loaded = load_recipe(recipe, [])
    changed = _resolved(recipe, "train.grad_accum=3", "split.token_budget=512",
                        "target.generation.batch_size=2", "train.loss.tv_weight=0.25",
                        "draft.target_layer_ids=[0,2]")
    assert recipe_changes(saved, changed) == [
        f"draft.target_layer_ids: {list(loaded.draft.target_layer_ids)} -> [0, 2]".replace("'", ""),
        f"split.token_budget: {loaded.split.token_budget} -> 512",
        f"target.generation.batch_size: {loaded.target.generation.batch_size} -> 2",
        f"train.grad_accum: {loaded.train.grad_accum} -> 3",
        f"train.loss.tv_weight: {loaded.train.loss.tv_weight} -> 0.25",
    ]


def test_a_key_on_one_side_only_is_shown_absent():
    assert recipe_changes("train:\n  grad_accum: 2\n", "train: {}\n") == ["train.grad_accum: 2 -> (absent)"]
    assert recipe_changes("data: {}\n", "data:\n  shuffle_seed: 4\n") == ["data.shuffle_seed: (absent) -> 4"]
    assert recipe_changes("split:\n  target_ranks: [0]\n", "split:\n  target_ranks: [0, 1]\n") == [
        "split.target_ranks: [0] -> [0, 1]"]


def _trainer(run_dir: Path, recipe_yaml: str, **overrides) -> Trainer:
    return Trainer(model_config=tiny_model_config(num_hidden_layers=1),
                   train=train_config(str(run_dir), **overrides), embeddings=target_embeddings(),
                   run_dir=run_dir, recipe_yaml=recipe_yaml)


SAVED = "train:\n  grad_accum: 1\n  log_interval: 4\n"


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("saved") / "run"
    _trainer(run, SAVED, steps=2, checkpoint_interval=2).fit(pack(chain_samples(12), 90))
    return run


def test_a_resume_under_a_changed_recipe_says_so_and_under_the_same_one_does_not(saved_run, capsys):
    path = ckpt.complete_checkpoints(saved_run)[-1]
    assert (path / ckpt.RECIPE_FILE).read_text() == SAVED
    _trainer(saved_run, SAVED, steps=4, resume="auto").resume()
    _trainer(saved_run, "train:\n  grad_accum: 1\n  log_interval: 9\n", steps=4, resume="auto").resume()
    assert "differs from the one" not in capsys.readouterr().out
    _trainer(saved_run, "train:\n  grad_accum: 2\n  log_interval: 4\n", steps=4, resume="auto").resume()
    out = capsys.readouterr().out
    assert (f"[trainer] note: this recipe differs from the one {path.name} was trained with "
            f"({path / ckpt.RECIPE_FILE}) in what is trained: train.grad_accum: 1 -> 2. The steps "
            "from 3 on follow this recipe, so the run no longer repeats the checkpointed one") in out


def test_a_checkpoint_without_a_recipe_or_a_run_without_one_gives_no_note(tmp_path):
    assert resume_note(tmp_path, "train: {}\n", next_step=1) == ""
    (tmp_path / ckpt.RECIPE_FILE).write_text("train:\n  grad_accum: 1\n")
    assert resume_note(tmp_path, None, next_step=1) == ""
    (tmp_path / ckpt.RECIPE_FILE).write_text("train: [unclosed\n")
    note = resume_note(tmp_path, "train: {}\n", next_step=1)
    assert note.startswith(f"{tmp_path / ckpt.RECIPE_FILE} could not be read to compare recipes (")


def test_a_failed_prune_leaves_the_complete_save_standing(tmp_path, monkeypatch, capsys):
    """Pruning ran on trainer rank 0 outside the save's error handling, before the ranks agree
    on the outcome: an OSError there (a network file system's ESTALE) left the other ranks
    waiting in that collective for a peer that had raised. The save is complete by then, so
    the failure is a warning and the older checkpoints stay."""
    def failing(run_dir, *, step, keep_last):
        raise OSError(5, "Input/output error")

    trainer = _trainer(tmp_path / "run", SAVED, steps=2)
    first = trainer.save()
    monkeypatch.setattr(ckpt, "_prune", failing)
    trainer.step = 1
    second = trainer.save()
    assert ckpt.complete_checkpoints(tmp_path / "run") == [first, second]
    assert (f"[trainer] warning: {second} is saved, but removing older checkpoints failed (OSError: "
            "[Errno 5] Input/output error)") in capsys.readouterr().err


def test_a_steps_token_count_is_exact_past_float32(tmp_path, monkeypatch):
    """The step's scalars were summed in float32: three micro-batches of 2^24 + 1 tokens each
    (a large multi-rank step) logged 50,331,648 tokens, not 50,331,651. They are float64 now."""
    from draftforge.train import sample as S

    monkeypatch.setattr(S.Batch, "num_tokens", property(lambda self: 2**24 + 1))
    logged = []
    _trainer(tmp_path / "run", SAVED, steps=1, grad_accum=3).fit(
        pack(chain_samples(12), 90), on_step=logged.append)
    assert [record["tokens"] for record in logged] == [3 * (2**24 + 1)]
