"""The demo's reruns after a review (session 48): what counts as another recipe's run, what an
interrupted --force says, where the DFlash run goes, and how --force deletes."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-cpu.yaml"


@pytest.mark.parametrize("override", ["train.max_bad_steps=50", "train.log_interval=5",
                                      "train.checkpoint_interval=20", "name=my-cpu",
                                      "split.peer_timeout_s=900"])
def test_settings_that_do_not_change_the_training_keep_a_finished_run(tmp_path, monkeypatch, override):
    """The trainer resumes across these without a note (NOT_TRAINED); the demo refused the run
    and told the user to delete it with --force."""
    from draftforge.config import load_recipe
    from draftforge.eval import demo_state
    from draftforge.train import checkpoint as ckpt

    monkeypatch.setattr(ckpt, "complete_checkpoints", lambda run_dir: [run_dir / "step"])
    (tmp_path / "config.yaml").write_text(load_recipe(RECIPE).to_yaml())
    demo_state.check_same_recipe(tmp_path, load_recipe(RECIPE, [override]).to_yaml(), "DSpark")


def test_a_setting_that_changes_the_training_is_still_another_recipe(tmp_path, monkeypatch):
    from draftforge.config import load_recipe
    from draftforge.eval import demo, demo_state
    from draftforge.train import checkpoint as ckpt

    monkeypatch.setattr(ckpt, "complete_checkpoints", lambda run_dir: [run_dir / "step"])
    (tmp_path / "config.yaml").write_text(load_recipe(RECIPE).to_yaml())
    for override, says in (("train.steps=100", "steps: 100"), ("train.lr=0.002", "lr: 0.002"),
                           ("data.num_samples=64", "num_samples: 64")):
        with pytest.raises(demo.DemoError, match=says):
            demo_state.check_same_recipe(tmp_path, load_recipe(RECIPE, [override]).to_yaml(), "DSpark")


def test_without_untrained_drops_keys_and_sections_only_where_listed():
    from draftforge.train.recipe_changes import without_untrained

    tree = {"name": "x", "train": {"log_interval": 5, "lr": 1e-3, "wandb": {"project": "p"}},
            "eval": {"num_prompts": 8}, "split": {"peer_timeout_s": 60, "token_budget": 1024},
            "target": {"cache_dir": "/c", "model": "m"}}
    assert without_untrained(tree) == {"train": {"lr": 1e-3}, "split": {"token_budget": 1024},
                                       "target": {"model": "m"}}
