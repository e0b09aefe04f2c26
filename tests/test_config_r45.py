"""Recipes and the launcher (review round 45): the GPUs a dry run plans for gloo trainers of
``train.device: auto``, and an unquoted ``None`` (YAML's string 'None', not null) for a key
that takes null."""

from __future__ import annotations

import pytest
from splitserve_helpers import tiny_recipe

from draftforge.config import RecipeError, load_recipe, validate_recipe
from draftforge.recipe_yaml import _parse_yaml
from draftforge.splitserve import launch
from draftforge.splitserve.roles import gloo_trainer_gpu


@pytest.mark.parametrize("trainers", [1, 2])
def test_a_dry_run_plans_the_gpus_of_gloo_trainers_of_device_auto(tmp_path, capsys, trainers):
    """Over gloo a trainer of train.device auto takes a GPU of its own on a GPU machine, as one
    of train.device cuda does (roles._device): the dry run, which plans for a GPU machine,
    plans those GPUs, where it planned none and printed no GPU line."""
    gloo = ["train.device=auto", "split.comm_backend=gloo"]
    cfg = load_recipe(tiny_recipe(tmp_path, trainers=trainers), gloo)
    # the GPUs the trainers take when they start (gloo_trainer_gpu), counted independently
    taken = {gloo_trainer_gpu(cfg.split, rank) for rank in cfg.split.trainer_ranks}
    assert launch.planned_gpus(cfg) == max(taken) + 1 == trainers
    assert launch.main([str(tmp_path / "recipe.yaml"), *gloo, "--dry-run"]) == 0
    need = "GPU 0" if trainers == 1 else "GPUs 0-1"
    assert f"GPUs: this machine needs {trainers} ({need})" in capsys.readouterr().out
    # train.device cpu over gloo takes no GPU
    assert launch.planned_gpus(load_recipe(tmp_path / "recipe.yaml", ["split.comm_backend=gloo"])) == 0


@pytest.mark.parametrize("key", ["export.out_dir", "target.cache_dir", "data.regenerated_file"])
def test_an_unquoted_none_for_a_nullable_key_is_refused(tmp_path, key):
    """``export.out_dir=None`` is the string 'None' in YAML: it exported into a folder ./None
    instead of the default. Refused at the override or the file's line, naming null."""
    recipe = tiny_recipe(tmp_path, overrides={"data.regenerate": True})
    with pytest.raises(RecipeError) as caught:
        load_recipe(recipe, [f"{key}=None"])
    problem, = caught.value.problems
    assert problem.startswith(f"command line '{key}=None': {key}: unquoted None is the string")
    assert "write null (or ~)" in problem
    text = recipe.read_text() + "export:\n  out_dir: None\n"
    (tmp_path / "file.yaml").write_text(text)
    with pytest.raises(RecipeError, match=rf"file.yaml:{text.count(chr(10))}: export.out_dir: unquoted None"):
        load_recipe(tmp_path / "file.yaml")
    # null is none; a quoted 'None' is the string, and the resolved recipe loads back the same
    section, name = key.split(".")
    assert getattr(getattr(load_recipe(recipe, [f"{key}=null"]), section), name) is None
    cfg = load_recipe(recipe, ["export.out_dir='None'"])
    assert cfg.export.out_dir == "None"
    data, lines, booleans, problems = _parse_yaml(cfg.to_yaml(), "config.yaml")
    assert problems == [] and validate_recipe(data, lines=lines, booleans=booleans) == cfg


def test_an_unquoted_none_for_a_nullable_number_names_null(tmp_path):
    with pytest.raises(RecipeError, match=r"split.world_size: expected int, got str 'None' "
                                          r"\(unquoted None is the string 'None' in YAML, not null"):
        load_recipe(tiny_recipe(tmp_path), ["split.world_size=None"])
    # a key that takes no null is not told to write null
    with pytest.raises(RecipeError) as caught:
        load_recipe(tiny_recipe(tmp_path), ["train.steps=None"])
    assert "null" not in str(caught.value)
