"""The model card's recipe is the one that trained the exported checkpoint: each checkpoint
keeps its run segment's recipe (``recipe.yaml``). Export took the run folder's config.yaml,
which a later rerun rewrites even when it trains nothing (``train.steps`` already reached),
so a step-4 checkpoint's card showed ``steps: 2``."""

from __future__ import annotations

from pathlib import Path

from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.train import checkpoint as ckpt
from draftforge.train.export_cli import saved_recipe
from draftforge.train.sample import pack
from draftforge.train.trainer import Trainer


def _fit(run: Path, recipe_yaml: str, steps: int) -> Trainer:
    trainer = Trainer(model_config=tiny_model_config(num_hidden_layers=1),
                      train=train_config(str(run), steps=steps, checkpoint_interval=2, resume="auto"),
                      embeddings=target_embeddings(), run_dir=run, recipe_yaml=recipe_yaml)
    trainer.resume()  # as a trainer rank does: the newest checkpoint, if any
    trainer.fit(pack(chain_samples(12), 90))
    return trainer


def test_a_rerun_that_trains_nothing_leaves_the_checkpoints_recipe_for_the_card(tmp_path):
    run = tmp_path / "run"
    _fit(run, "name: first\n# steps: 4\n", steps=4)
    newest = run / "checkpoints" / "step_00000004"
    assert (newest / ckpt.RECIPE_FILE).read_text() == "name: first\n# steps: 4\n"
    assert saved_recipe(run) == newest / ckpt.RECIPE_FILE
    assert saved_recipe(newest) == newest / ckpt.RECIPE_FILE  # a checkpoint named directly
    ckpt.release_run_dir(run)

    rerun = _fit(run, "name: second\n# steps: 2\n", steps=2)  # already past step 2: trains nothing
    assert rerun.step == 4
    assert (run / "config.yaml").read_text() == "name: second\n# steps: 2\n"  # the newest segment's
    assert saved_recipe(run) == newest / ckpt.RECIPE_FILE  # the card still shows the first
    assert (newest / ckpt.RECIPE_FILE).read_text() == "name: first\n# steps: 4\n"
    ckpt.release_run_dir(run)


def test_a_checkpoint_saved_before_recipes_were_kept_falls_back_to_config_yaml(tmp_path):
    run = tmp_path / "run"
    _fit(run, "name: first\n", steps=2)
    ckpt.release_run_dir(run)
    (run / "checkpoints" / "step_00000002" / ckpt.RECIPE_FILE).unlink()
    assert saved_recipe(run) == run / "config.yaml"
