"""Review round 7 of the recipe loader: a bad recipe is an InputError like any other unusable
input, and a draft never takes the placeholder 2048 for a target whose max_position_embeddings
is unknown."""

import json
from pathlib import Path

import pytest
import yaml

from draftforge import cli
from draftforge.config import RecipeError, load_recipe
from draftforge.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-debug.yaml"

# a local target folder whose config.json, like some, gives no max_position_embeddings
CONFIG = {"num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 49152, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 128, "rope_theta": 10000.0}

RECIPE = """\
target:
  model: {model}
draft:
  hidden_size: 64
  num_attention_heads: 4
  num_key_value_heads: 2
  intermediate_size: 128
  target_layer_ids: [0, 1, 2]
  block_size: 4
  markov_rank: 16
data:
  max_length: 128
split:
  target_ranks: [0]
  trainer_ranks: [1]
train:
  strategy: single
  steps: 20
"""
DRAFT_LINE = 3  # "draft:" above: where a key the recipe leaves out is reported


def _recipe(tmp_path: Path, config: dict = CONFIG) -> tuple[Path, Path]:
    model = tmp_path / "target"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(config))
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE.format(model=model))
    return path, model


# --------------------------------------------------------------------------- RecipeError


def test_a_bad_recipe_key_through_the_cli_exits_2_naming_the_key(capsys):
    assert cli.main(["config", "show", str(TINY), "draft.block_sise=8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("draftforge config show: invalid recipe:\n"
                          "command line 'draft.block_sise=8': draft.block_sise: unknown key")
    assert "Traceback" not in err
    assert cli.main(["train", str(TINY), "--dry-run", "train.stepz=3"]) == 2
    assert "command line 'train.stepz=3': train.stepz: unknown key" in capsys.readouterr().err


def test_a_bad_recipe_is_caught_with_every_other_unusable_input():
    # a program (or a draftforge command) that catches InputError for whatever the user handed
    # it, as draftforge.errors promises, also catches a bad recipe, with its problems
    with pytest.raises(InputError) as err:
        load_recipe(TINY, ["draft.block_size=1"])
    assert isinstance(err.value, RecipeError)
    assert err.value.problems == [
        "command line 'draft.block_size=1': draft.block_size: must be greater than or equal to 2, "
        "got int 1"
    ]


# --------------------------------------------------------------------------- max_position_embeddings


def test_a_target_that_gives_no_max_position_embeddings_is_refused_naming_the_key(tmp_path):
    path, model = _recipe(tmp_path)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert err.value.problems == [
        f"{path}:{DRAFT_LINE}: draft.max_position_embeddings: not set, and the target's is not "
        f"known ({model / 'config.json'} gives none and target.shape does not declare "
        "max_position_embeddings): set it to the longest position the draft is to serve (at "
        "least data.max_length 128; it becomes the export's max_position_embeddings and bounds "
        "eval's prompts), or declare target.shape.max_position_embeddings"
    ]


def test_the_refusal_reaches_the_user_through_the_cli(tmp_path, capsys):
    path, _ = _recipe(tmp_path)
    assert cli.main(["config", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("draftforge config show: invalid recipe:\n")
    assert f"{path}:{DRAFT_LINE}: draft.max_position_embeddings: not set" in err


def test_a_set_draft_max_position_embeddings_is_used_and_not_checked_against_a_placeholder(tmp_path):
    from draftforge.splitserve.registry import resolve_target_shape
    from draftforge.train.config import build_dspark_config

    path, _ = _recipe(tmp_path)
    # 3000 positions of data: beyond the section's placeholder 2048, which is not the target's
    overrides = ["draft.max_position_embeddings=4096", "data.max_length=3000", "split.token_budget=4096"]
    cfg = load_recipe(path, overrides)
    assert cfg.draft.max_position_embeddings == 4096
    assert build_dspark_config(cfg.draft, resolve_target_shape(cfg.target)).max_position_embeddings == 4096
    shown = yaml.safe_load(cfg.to_yaml())
    assert "max_position_embeddings" not in shown["target"]["shape"]  # never recorded as the target's
    resolved = tmp_path / "resolved.yaml"  # what a run records, reloaded by export and eval
    resolved.write_text(cfg.to_yaml())
    assert load_recipe(resolved) == cfg


def test_a_declared_or_given_target_max_position_embeddings_is_still_the_default(tmp_path):
    given, _ = _recipe(tmp_path / "given", CONFIG | {"max_position_embeddings": 640})
    assert load_recipe(given).draft.max_position_embeddings == 640
    path, _ = _recipe(tmp_path / "declared")  # its config.json gives none: the recipe does
    shape = "target.shape={num_hidden_layers: 4, hidden_size: 64, vocab_size: 49152, max_position_embeddings: 320}"
    assert load_recipe(path, [shape]).draft.max_position_embeddings == 320
    # model: random is built from its shape, so the section's default is its real value
    assert load_recipe(TINY).draft.max_position_embeddings == 2048
