"""Every recipe shipped in recipes/ loads strictly and says how to run it."""

from pathlib import Path

import pytest
import yaml

from draftforge.config import load_recipe, validate_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(
    path.relative_to(ROOT)
    for pattern in ("**/*.yaml", "**/*.yml")
    for path in (ROOT / "recipes").glob(pattern)
)


def test_recipes_exist():
    assert Path("recipes/tiny-debug.yaml") in RECIPES


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_recipe_loads(recipe, monkeypatch):
    monkeypatch.chdir(ROOT)  # recipes name paths relative to the repository root
    cfg = load_recipe(recipe)
    assert cfg.name == recipe.stem
    # derived values are filled in
    assert cfg.draft.head_dim is not None
    assert cfg.split.world_size == len(cfg.split.target_ranks) + len(cfg.split.trainer_ranks)


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_recipe_first_line_is_its_command(recipe):
    first = (ROOT / recipe).read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith("#"), f"{recipe}: first line must be a comment with its command"
    assert "draftforge " in first, f"{recipe}: first line must give the draftforge command"
    assert recipe.as_posix() in first, f"{recipe}: the command must name the recipe itself"


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_resolved_recipe_round_trips(recipe, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_recipe(recipe)
    again = validate_recipe(yaml.safe_load(cfg.to_yaml()), source="resolved")
    assert again == cfg


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_every_recipe_builds_its_draft_config(recipe, monkeypatch):
    from draftforge.splitserve.registry import resolve_target_shape
    from draftforge.train.config import build_dspark_config

    monkeypatch.chdir(ROOT)
    cfg = load_recipe(recipe)
    shape = resolve_target_shape(cfg.target)
    model_cfg = build_dspark_config(cfg.draft, shape)
    assert model_cfg.block_size == cfg.draft.block_size
    assert model_cfg.target_layer_ids == cfg.draft.target_layer_ids
    assert model_cfg.vocab_size == shape.vocab_size
