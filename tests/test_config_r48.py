"""The recipe loader after a review (session 48): an override's '#', a KL-only loss, a target
shape declared in part, and what config.json files crash on."""

from pathlib import Path

import pytest
from test_config_r7 import _recipe

from draftforge.config import RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-debug.yaml"


@pytest.mark.parametrize("override,left", [
    ("train.output_dir=runs/exp #2", "runs/exp"),
    ("name=exp #2", "exp"),
    ("train.steps=10 # ten", "10"),
    ("data.train_files=[a, b] # two", "[a, b]"),
])
def test_an_override_whose_value_holds_a_comment_is_refused(override, left):
    """YAML reads ' #...' as a comment: the value was silently cut (runs/exp #2 trained into,
    and pruned checkpoints of, runs/exp)."""
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, [override])
    (problem,) = info.value.problems
    assert problem.startswith(f"command line {override!r}: ")
    assert f"reads as a YAML comment and would be dropped, leaving {left!r}" in problem
    assert "quote the text that holds the '#'" in problem


def test_a_quoted_or_glued_hash_is_kept():
    assert load_recipe(TINY, ['train.output_dir="runs/exp #2"']).train.output_dir == "runs/exp #2"
    assert load_recipe(TINY, ["train.output_dir=runs/exp#2"]).train.output_dir == "runs/exp#2"
    assert load_recipe(TINY, ["name='a # b'"]).name == "a # b"


def test_a_kl_only_loss_trains_the_predictions_and_is_accepted():
    cfg = load_recipe(TINY, ["train.loss={ce_weight: 0, tv_weight: 0, kl_weight: 1}"])
    assert (cfg.train.loss.ce_weight, cfg.train.loss.tv_weight, cfg.train.loss.kl_weight) == (0, 0, 1)
    with pytest.raises(RecipeError, match="give one of the three a positive weight"):
        load_recipe(TINY, ["train.loss={ce_weight: 0, tv_weight: 0, kl_weight: 0}"])


def test_declaring_only_the_key_an_error_asks_for_completes_the_shape_from_the_target(tmp_path):
    """The draft.max_position_embeddings error says to declare target.shape.max_position_embeddings
    for a folder whose config.json lacks it; that declaration alone was refused for the three
    fields a shape must have, although the folder gives them."""
    path, model = _recipe(tmp_path)
    cfg = load_recipe(path, ["target.shape.max_position_embeddings=4096"])
    shape = cfg.target.shape
    assert (shape.num_hidden_layers, shape.hidden_size, shape.vocab_size) == (4, 64, 49152)
    assert shape.max_position_embeddings == 4096
    assert cfg.draft.max_position_embeddings == 4096  # taken as the target's
    # a random target has no config to take them from: still required, by name
    text = TINY.read_text().replace("    hidden_size: 64\n    vocab_size", "    vocab_size", 1)
    assert text != TINY.read_text()
    random = tmp_path / "random.yaml"
    random.write_text(text)
    with pytest.raises(RecipeError, match="target.shape.hidden_size: required key missing"):
        load_recipe(random)


@pytest.mark.parametrize("text,steps", [("08", 8), ("09", 9), ("019", 19), ("010", 10), ("0_9", 9)])
def test_a_leading_zero_is_decimal_whatever_the_digits(text, steps):
    """'07' and '010' were ints and '08', '09', '019' strings (refused for an int key): the
    pattern only took octal digits after the zero, though the constructor reads decimal."""
    assert load_recipe(TINY, [f"train.steps={text}"]).train.steps == steps


def test_a_config_json_whose_text_config_is_null_or_not_an_object(tmp_path):
    from test_config_r7 import CONFIG

    path, model = _recipe(tmp_path / "null", {**CONFIG, "max_position_embeddings": 4096,
                                              "text_config": None})
    assert load_recipe(path).target.model == str(model)  # null: no text config, the top level is it
    path, model = _recipe(tmp_path / "text", {**CONFIG, "text_config": "llama"})
    with pytest.raises(RecipeError, match="text_config holds a JSON str, not an object"):
        load_recipe(path)


def test_nesting_hundreds_deep_is_a_located_error_not_a_traceback(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text(TINY.read_text() + "\nextra: " + "[" * 700 + "]" * 700 + "\n")
    with pytest.raises(RecipeError, match=f"{path}: nesting too deep"):
        load_recipe(path)
    with pytest.raises(RecipeError, match="value nested too deep"):
        load_recipe(TINY, ["train.steps=" + "[" * 700 + "]" * 700])


def test_a_resume_path_under_home_is_expanded_as_output_dir_is(monkeypatch, tmp_path):
    """A shell does not expand '~' in train.resume=~/... (the word starts with 'train'), and a
    recipe never does: train.output_dir was expanded, train.resume was taken literally."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_recipe(TINY, ["train.resume=~/runs/x/checkpoints/step_000100",
                             "train.output_dir=~/runs/x"])
    assert cfg.train.resume == f"{tmp_path}/runs/x/checkpoints/step_000100"
    assert cfg.train.output_dir == f"{tmp_path}/runs/x"
    assert load_recipe(TINY, ["train.resume=auto"]).train.resume == "auto"


def test_the_reference_says_a_list_may_not_be_empty():
    from draftforge.data.config import DataConfig
    from draftforge.reference import bounds

    assert bounds(DataConfig.model_fields["train_files"]) == "at least 1 item"
    with pytest.raises(RecipeError, match="data.train_files"):
        load_recipe(TINY, ["data.train_files=[]"])


def test_config_show_refuses_what_no_machine_could_run(capsys):
    """config show validated only what load_recipe checks; the split's rules that do not
    depend on the machine (here: strategy single with two trainer ranks, a restart without
    resume auto) were left to draftforge train."""
    from draftforge import cli

    assert cli.main(["config", "show", str(TINY), "train.strategy=single", "split.trainer_ranks=[1, 2]",
                     "split.restart_target=true", "train.resume=never"]) == 2
    err = capsys.readouterr().err
    assert "train.strategy 'single' trains in one process but the split has 2 trainer ranks" in err
    assert "split.restart_target: a restarted job continues from the newest checkpoint" in err
    assert "Traceback" not in err
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):  # every shipped recipe still shows
        assert cli.main(["config", "show", str(recipe)]) == 0, recipe
    capsys.readouterr()


def test_flex_with_device_auto_is_refused_before_the_target_loads_where_no_gpu_is_visible():
    """The recipe check refused flex with train.device cpu only; with auto on a machine without
    a GPU the trainer's first step failed after the target had loaded and answered."""
    from draftforge.splitserve.roles import split_problems

    overrides = ["draft.attention_backend=flex", "train.device=auto", "draft.head_dim=16"]
    cfg = load_recipe(TINY, overrides)
    (problem,) = [p for p in split_problems(cfg, world_size=2, cuda_devices=0) if "flex" in p]
    assert problem.startswith("draft.attention_backend: flex cannot train on the CPU")
    assert not [p for p in split_problems(cfg, world_size=2, cuda_devices=1) if "flex" in p]
