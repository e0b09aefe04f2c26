"""Strict recipe loading: every error kind, with the message it must give."""

import subprocess
import sys
import textwrap
import types

import pytest
import yaml
from recipe_helpers import TINY_RECIPE

from draftforge import cli
from draftforge.config import RecipeConfig, RecipeError, dump_recipe, load_recipe

# recipe_helpers' tiny recipe with a learning rate; line numbers below count from its first line.
BASE = TINY_RECIPE + "  lr: 1e-4\n"
LINE_OF = {line.strip().split(":")[0]: n for n, line in enumerate(BASE.splitlines(), start=1)}


def write(tmp_path, text, name="r.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def replace(key, new_line):
    """BASE with the line of `key` replaced (same indentation)."""
    lines = BASE.splitlines()
    index = LINE_OF[key] - 1
    indent = lines[index][: len(lines[index]) - len(lines[index].lstrip())]
    lines[index] = indent + new_line
    return "\n".join(lines) + "\n"


def problems(path, overrides=()):
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    return info.value.problems


# --------------------------------------------------------------------------- valid


def test_base_loads_and_derives(tmp_path):
    cfg = load_recipe(write(tmp_path, BASE, "my-run.yaml"))
    assert cfg.name == "my-run"
    assert cfg.draft.head_dim == 64 // 4
    assert cfg.draft.rope_theta == cfg.target.shape.rope_theta
    assert cfg.draft.max_position_embeddings == cfg.target.shape.max_position_embeddings
    assert cfg.split.target_ranks == [0]
    assert cfg.split.trainer_ranks == [1]
    assert cfg.split.world_size == 2
    assert isinstance(cfg.train.lr, float) and cfg.train.lr == 1e-4  # `1e-4` is a float


def test_name_in_file_wins_over_stem(tmp_path):
    assert load_recipe(write(tmp_path, "name: custom\n" + BASE)).name == "custom"


def test_empty_section_means_defaults(tmp_path):
    cfg = load_recipe(write(tmp_path, BASE + "eval:\n"))
    assert cfg.eval == RecipeConfig().eval


def test_resolved_yaml_round_trips(tmp_path):
    cfg = load_recipe(write(tmp_path, BASE))
    out = dump_recipe(cfg, tmp_path / "run" / "resolved.yaml")
    assert out.read_text().startswith("# ")
    assert load_recipe(out) == cfg
    assert yaml.safe_load(out.read_text())["draft"]["head_dim"] == 16
    assert [p.name for p in out.parent.iterdir()] == ["resolved.yaml"]  # no temp file left


# --------------------------------------------------------------------------- keys


def test_unknown_key_names_line_and_valid_keys(tmp_path):
    text = BASE.replace("  markov_rank: 16\n", "  markov_rank: 16\n  markov_head_typ: gated\n")
    line = LINE_OF["markov_rank"] + 1
    (problem,) = problems(write(tmp_path, text))
    assert problem.startswith(f"{tmp_path / 'r.yaml'}:{line}: draft.markov_head_typ: unknown key")
    assert "did you mean 'markov_head_type'?" in problem
    assert "valid keys: attention_backend, block_size, confidence_head_with_markov," in problem


def test_misspelt_nested_key(tmp_path):
    text = BASE + "  loss:\n    decy: 2.0\n"
    line = len(BASE.splitlines()) + 2
    (problem,) = problems(write(tmp_path, text))
    assert f"r.yaml:{line}: train.loss.decy: unknown key (did you mean 'decay'?)" in problem
    assert "valid keys: bce_weight, ce_weight, chunk_blocks, compile, decay," in problem


def test_unknown_section(tmp_path):
    (problem,) = problems(write(tmp_path, BASE + "drafts:\n  block_size: 4\n"))
    line = len(BASE.splitlines()) + 1
    assert f"r.yaml:{line}: drafts: unknown key (did you mean 'draft'?)" in problem
    assert "valid keys: data, draft, eval, export, name, split, target, train" in problem


def test_duplicate_key(tmp_path):
    text = BASE.replace("  block_size: 4\n", "  block_size: 4\n  block_size: 6\n")
    first = LINE_OF["block_size"]
    (problem,) = problems(write(tmp_path, text))
    assert problem.endswith(
        f"r.yaml:{first + 1}: draft.block_size: duplicate key (first given at line {first})"
    )


def test_duplicate_key_value_problems_point_at_the_value_yaml_kept(tmp_path):
    """YAML keeps the last of two equal keys, so a problem in that value is at its line."""
    text = BASE.replace("  block_size: 4\n", "  block_size: 4\n  block_size: '6'\n")
    first = LINE_OF["block_size"]
    found = problems(write(tmp_path, text))
    assert any(p.endswith(f"r.yaml:{first + 1}: draft.block_size: duplicate key (first given at line {first})")
               for p in found)
    assert any(f"r.yaml:{first + 1}: draft.block_size: expected int, got str '6'" in p for p in found), found


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    """An explicit key beside a merged one overrides it (YAML merge); it is not a duplicate."""
    text = BASE.replace("train:\n  strategy: single\n", "train: &t\n  strategy: single\n") + (
        "eval:\n  num_prompts: 3\n"
    )
    assert load_recipe(write(tmp_path, text)).train.strategy == "single"
    merged = (
        "x-common: &common\n  lr: 1e-4\n  steps: 5\n"
        + BASE.replace("train:\n  strategy: single\n  lr: 1e-4\n", "train:\n  <<: *common\n  strategy: single\n  steps: 7\n")
    )
    found = problems(write(tmp_path, merged))
    assert not any("duplicate" in p for p in found), found
    assert any("x-common: unknown key" in p for p in found)  # the anchor's own section is still checked


def test_all_errors_are_collected(tmp_path):
    text = replace("block_size", "block_size: '8'").replace("strategy: single", "strategy: dp")
    found = problems(write(tmp_path, text))
    assert len(found) == 2
    assert any("draft.block_size: expected int" in p for p in found)
    assert any("train.strategy: 'dp' is not one of" in p for p in found)


# --------------------------------------------------------------------------- values


def test_wrong_type(tmp_path):
    (problem,) = problems(write(tmp_path, replace("block_size", "block_size: '8'")))
    assert problem.endswith(
        f"r.yaml:{LINE_OF['block_size']}: draft.block_size: expected int, got str '8'"
    )


def test_bool_is_not_int(tmp_path):
    (problem,) = problems(write(tmp_path, replace("markov_rank", "markov_rank: true")))
    assert problem.endswith("draft.markov_rank: expected int, got bool True")


def test_bad_choice(tmp_path):
    (problem,) = problems(write(tmp_path, BASE + "  dtype: float16\n"))
    assert "r.yaml:20: train.dtype: 'float16' is not one of 'bfloat16', 'float32', 'auto'" in problem
    text = replace("markov_rank", "markov_head_type: vanila")
    (problem,) = problems(write(tmp_path, text))
    assert "draft.markov_head_type: 'vanila' is not one of 'vanilla', 'gated', 'rnn'" in problem
    assert "did you mean 'vanilla'?" in problem


def test_bad_choice_in_list(tmp_path):
    (problem,) = problems(write(tmp_path, BASE + "eval:\n  workloads: [humaneval, mbpp]\n"))
    assert "eval.workloads[1]: 'mbpp' is not one of 'humaneval', 'mtbench', 'gsm8k'" in problem


def test_block_size_one(tmp_path):
    (problem,) = problems(write(tmp_path, replace("block_size", "block_size: 1")))
    assert problem.endswith("draft.block_size: must be greater than or equal to 2, got int 1")


def test_random_target_needs_shape(tmp_path):
    (problem,) = problems(write(tmp_path, "target:\n  model: random\n"))
    assert (
        problem
        == f"{tmp_path / 'r.yaml'}:1: target: model 'random' needs a declared 'shape' section"
    )


# --------------------------------------------------------------------------- cross-section


def test_layer_id_equal_to_last_layer(tmp_path):
    (problem,) = problems(write(tmp_path, replace("target_layer_ids", "target_layer_ids: [0, 3]")))
    line = LINE_OF["target_layer_ids"]
    assert (
        f"r.yaml:{line}: draft.target_layer_ids[1]: layer id 3 is the target's final layer"
        in problem
    )
    assert "not allowed" in problem and "valid ids are 0..2" in problem


def test_layer_id_out_of_range(tmp_path):
    (problem,) = problems(write(tmp_path, replace("target_layer_ids", "target_layer_ids: [9]")))
    assert (
        "draft.target_layer_ids[0]: layer id 9 is out of range: the target has 4 layers" in problem
    )


def test_layer_ids_negative_duplicate_empty(tmp_path):
    found = problems(write(tmp_path, replace("target_layer_ids", "target_layer_ids: [1, 1, -2]")))
    assert any("draft.target_layer_ids: duplicate layer ids [1]" in p for p in found)
    assert any("draft.target_layer_ids[2]: layer id -2 is negative" in p for p in found)
    (problem,) = problems(write(tmp_path, replace("target_layer_ids", "target_layer_ids: []")))
    assert "draft.target_layer_ids: must list at least one target layer" in problem


def test_layer_ids_checked_against_a_known_target(tmp_path):
    # smollm2-135m-instruct has 30 layers: 28 is the last allowed, 29 the final layer
    text = "draft:\n  target_layer_ids: [1, 28]\n"
    assert load_recipe(write(tmp_path, text)).draft.head_dim == 576 // 8
    (problem,) = problems(write(tmp_path, "draft:\n  target_layer_ids: [29]\n"))
    assert "layer id 29 is the target's final layer" in problem and "0..28" in problem


def test_declared_shape_must_match_known_target(tmp_path):
    text = "target:\n  shape:\n    num_hidden_layers: 30\n    hidden_size: 512\n    vocab_size: 49152\n"
    found = problems(write(tmp_path, text))
    assert any(
        "r.yaml:4: target.shape.hidden_size: 512 differs from smollm2-135m-instruct's hidden_size 576"
        in p
        for p in found
    )


def test_a_partly_declared_shape_takes_the_rest_from_the_known_target(tmp_path):
    """A recipe may declare a few shape fields (the Ling recipes declare four, for dry runs
    without the weights); where the target's config is known, the fields it leaves out come
    from it, not from the random target's defaults, and the resolved recipe reloads."""
    text = "target:\n  shape:\n    num_hidden_layers: 30\n    hidden_size: 576\n    vocab_size: 49152\n"
    cfg = load_recipe(write(tmp_path, text))
    plain = load_recipe(write(tmp_path, "target:\n  model: smollm2-135m-instruct\n", "plain.yaml"))
    assert cfg.draft.rope_theta == plain.draft.rope_theta == 100000.0
    assert cfg.draft.max_position_embeddings == plain.draft.max_position_embeddings == 8192
    assert cfg.target.shape.num_attention_heads == 9 and cfg.target.shape.intermediate_size == 1536
    saved = dump_recipe(cfg, tmp_path / "run" / "config.yaml")
    again = load_recipe(saved)  # as export reloads a run's config.yaml: no made-up mismatches
    assert again.target.shape == cfg.target.shape and again.draft == cfg.draft
    # and the data limit is the target's 8192 positions, not the default 2048
    assert load_recipe(write(tmp_path, text + "data:\n  max_length: 4096\n")).data.max_length == 4096


def test_an_unknown_target_name_is_refused_at_its_line(tmp_path):
    (problem,) = problems(write(tmp_path, "target:\n  model: smollm2-135m\n"))
    assert "r.yaml:2: target.model: 'smollm2-135m' is neither a registered name" in problem
    assert "smollm2-135m-instruct, random" in problem and "declare target.shape" in problem
    # a folder that is not here is fine once its shape is declared (a dry run without weights)
    declared = load_recipe(write(tmp_path, BASE.replace("model: random", "model: /no/such/model")),
                           ["target.shape.max_position_embeddings=2048"])
    assert declared.target.shape.hidden_size == 64


def test_empty_workloads_and_train_files_are_refused(tmp_path):
    """An empty eval.workloads made 'eval --recipe' print an empty table and al_dspark=nan."""
    found = problems(write(tmp_path, BASE + "eval:\n  workloads: []\ndata:\n  train_files: []\n"))
    assert any("eval.workloads: must hold at least 1 item" in p for p in found)
    assert any("data.train_files: must hold at least 1 item" in p for p in found)


def test_mask_token_outside_vocab(tmp_path):
    (problem,) = problems(write(tmp_path, replace("mask_token_id", "mask_token_id: 512")))
    assert (
        f":{LINE_OF['mask_token_id']}: draft.mask_token_id: 512 is outside the target vocabulary"
        in problem
    )
    assert "vocab_size 512" in problem
    assert load_recipe(write(tmp_path, replace("mask_token_id", "mask_token_id: 511")))


def test_hidden_not_divisible_by_heads(tmp_path):
    text = BASE.replace(
        "  hidden_size: 64\n  num_attention_heads: 4", "  hidden_size: 64\n  num_attention_heads: 5"
    )
    found = problems(write(tmp_path, text))
    assert any(
        "draft.hidden_size: 64 is not divisible by num_attention_heads 5" in p for p in found
    )
    # an explicit head_dim lifts the divisibility requirement
    text = text.replace(
        "  num_key_value_heads: 2\n  target", "  num_key_value_heads: 5\n  head_dim: 16\n  target"
    )
    cfg = load_recipe(write(tmp_path, text))
    assert cfg.draft.head_dim == 16


def test_kv_heads_must_divide_heads(tmp_path):
    text = BASE.replace("  num_key_value_heads: 2\n  target", "  num_key_value_heads: 3\n  target")
    (problem,) = problems(write(tmp_path, text))
    assert "draft.num_key_value_heads: 3 does not divide num_attention_heads 4" in problem


def test_random_target_shape_checked(tmp_path):
    text = BASE.replace("    num_key_value_heads: 2\n", "    num_key_value_heads: 3\n", 1)
    (problem,) = problems(write(tmp_path, text))
    assert "r.yaml:8: target.shape.num_key_value_heads: 3 does not divide" in problem


def test_draft_hidden_must_equal_target_hidden(tmp_path):
    text = BASE.replace("draft:\n  hidden_size: 64", "draft:\n  hidden_size: 128")
    (problem,) = problems(write(tmp_path, text))
    assert "draft.hidden_size: 128 differs from the target's hidden_size 64" in problem


def test_markov_rank_zero_with_markov_confidence_head(tmp_path):
    (problem,) = problems(write(tmp_path, replace("markov_rank", "markov_rank: 0")))
    assert "draft.markov_rank: 0 disables the Markov head" in problem
    assert "confidence_head_with_markov: false" in problem
    # the DFlash ablation: no Markov head, no confidence head
    dflash = replace("markov_rank", "markov_rank: 0\n  enable_confidence_head: false")
    assert load_recipe(write(tmp_path, dflash)).draft.markov_rank == 0


def test_token_budget_below_the_longest_sample_is_refused(tmp_path):
    path = write(tmp_path, BASE)
    (problem,) = problems(path, ["data.max_length=512", "split.token_budget=256"])
    assert "split.token_budget: 256 is less than data.max_length 512" in problem
    assert load_recipe(path, ["data.max_length=256", "split.token_budget=256"]).split.token_budget == 256


def test_samples_longer_than_the_target_positions_are_refused(tmp_path):
    path = write(tmp_path, BASE)
    limit = load_recipe(path).draft.max_position_embeddings  # derived from the target
    (problem,) = problems(path, [f"data.max_length={limit + 1}", f"split.token_budget={limit + 1}"])
    assert f"data.max_length: {limit + 1} is beyond the target's max_position_embeddings {limit}" in problem


def test_infinite_values_and_a_loss_that_trains_nothing_are_refused(tmp_path):
    path = write(tmp_path, BASE)
    (problem,) = problems(path, ["train.lr=.inf"])
    assert "train.lr: must be a finite number, got float inf" in problem
    (problem,) = problems(path, ["train.loss.ce_weight=0.0", "train.loss.tv_weight=0.0"])
    assert "train.loss.tv_weight: 0 with ce_weight and kl_weight 0 as well: nothing would train" in problem
    assert load_recipe(path, ["train.loss.tv_weight=0.0"]).train.loss.ce_weight > 0


def test_warmup_that_leaves_no_decay_is_refused(tmp_path):
    path = write(tmp_path, BASE)
    (problem,) = problems(path, ["train.steps=10", "train.warmup_ratio=0.95"])
    assert "train.warmup_ratio: 0.95 of 10 steps is 10 warmup steps, which leaves none" in problem
    assert load_recipe(path, ["train.steps=10", "train.warmup_ratio=0.9"]).train.warmup_ratio == 0.9


def test_dpace_weights_with_accumulation_are_refused(tmp_path):
    """D-PACE weights need each micro-batch's forward, so the step's weight sum cannot divide
    every micro-batch; exp weights can be summed ahead and accumulate exactly."""
    path = write(tmp_path, BASE)
    (problem,) = problems(path, ["train.grad_accum=2", "train.loss.position_weighting=dpace"])
    assert "train.grad_accum: 2 micro-batches with train.loss.position_weighting: dpace" in problem
    assert "use position_weighting: exp" in problem
    assert load_recipe(path, ["train.grad_accum=2"]).train.grad_accum == 2
    assert load_recipe(path, ["train.loss.position_weighting=dpace"]).train.loss.position_weighting == "dpace"


# --------------------------------------------------------------------------- split


def split_recipe(tmp_path, text):
    return write(tmp_path, BASE + "split:\n" + textwrap.indent(textwrap.dedent(text), "  "))


def test_split_overlap(tmp_path):
    (problem,) = problems(split_recipe(tmp_path, "target_ranks: [0, 1]\ntrainer_ranks: [1, 2]\n"))
    assert "split.trainer_ranks: ranks [1] are in both target_ranks and trainer_ranks" in problem


def test_split_must_cover_world(tmp_path):
    (problem,) = problems(
        split_recipe(tmp_path, "target_ranks: [0]\ntrainer_ranks: [2]\nworld_size: 3\n")
    )
    assert "split.world_size: 3: target_ranks and trainer_ranks must together cover 0..2" in problem
    assert "ranks [1] are in neither group" in problem


def test_split_derivations(tmp_path):
    cfg = load_recipe(split_recipe(tmp_path, "target_ranks: [0, 1]\nworld_size: 5\n"))
    assert cfg.split.trainer_ranks == [2, 3, 4]
    cfg = load_recipe(split_recipe(tmp_path, "target_ranks: [2]\ntrainer_ranks: [0, 1]\n"))
    assert cfg.split.world_size == 3


def test_split_empty_trainer_group_tp_and_devices(tmp_path):
    (problem,) = problems(split_recipe(tmp_path, "target_ranks: [0, 1]\nworld_size: 2\n"))
    assert "split.trainer_ranks: the trainer group is empty" in problem
    found = problems(
        split_recipe(
            tmp_path,
            "target_ranks: [0, 1, 2]\ntarget_tensor_parallel: 2\ntrainer_ranks: [3]\n"
            "trainer_devices: [0, 1]\n",
        )
    )
    assert any(
        "split.target_tensor_parallel: 2 does not divide the target group size 3" in p
        for p in found
    )
    assert any("split.trainer_devices: lists 2 device(s) for 1 trainer rank(s)" in p for p in found)


# --------------------------------------------------------------------------- overrides


def test_good_override_changes_value(tmp_path):
    path = write(tmp_path, BASE)
    cfg = load_recipe(
        path, ["draft.block_size=8", "train.loss.decay=2.5", "eval.workloads=[gsm8k]"]
    )
    assert cfg.draft.block_size == 8
    assert cfg.train.loss.decay == 2.5
    assert cfg.eval.workloads == ["gsm8k"]
    assert load_recipe(path).draft.block_size == 4


def test_an_override_changes_one_key_where_a_yaml_alias_shares_its_section(tmp_path):
    text = BASE.replace("target:\n  model: random\n", "target:\n  model: random\n"
                        "  generation: &g {temperature: 0.7, max_new_tokens: 64}\n") + "eval: *g\n"
    path = write(tmp_path, text)
    cfg = load_recipe(path, ["target.generation.temperature=0.0"])
    assert cfg.target.generation.temperature == 0.0 and cfg.eval.temperature == 0.7
    cfg = load_recipe(path, ["eval.max_new_tokens=8"])
    assert cfg.eval.max_new_tokens == 8 and cfg.target.generation.max_new_tokens == 64


def test_a_string_that_reads_as_a_number_is_quoted_in_the_resolved_recipe(tmp_path):
    """The loader reads 1e5 as a float (YAML 1.1 would not); the resolved recipe must quote a
    string that looks so, or it would not load back."""
    cfg = load_recipe(write(tmp_path, BASE + "name: '1e5'\n"))
    assert cfg.name == "1e5"
    again = write(tmp_path, cfg.to_yaml(), name="again.yaml")
    assert load_recipe(again).name == "1e5" and load_recipe(again).train.lr == 1e-4


def test_a_leading_zero_is_decimal_not_octal(tmp_path):
    """YAML 1.1 reads 010 as 8; a recipe means 10, in the file and on the command line."""
    path = write(tmp_path, BASE.replace("  block_size: 4", "  block_size: 010"))
    assert load_recipe(path).draft.block_size == 10
    cfg = load_recipe(write(tmp_path, BASE, name="b.yaml"), ["data.max_length=0640", "draft.mask_token_id=0x1f"])
    assert cfg.data.max_length == 640 and cfg.draft.mask_token_id == 31  # hexadecimal stays hexadecimal


def test_a_mapping_override_merges_into_its_section_and_a_key_is_given_once(tmp_path):
    path = write(tmp_path, BASE + "  loss:\n    chunk_blocks: 8\n    decay: 2.0\n")
    cfg = load_recipe(path, ["train.loss={ce_weight: 1.0, decay: 3.0}"])
    assert (cfg.train.loss.ce_weight, cfg.train.loss.decay, cfg.train.loss.chunk_blocks) == (1.0, 3.0, 8)
    with pytest.raises(RecipeError, match=r"command line 'draft.block_size=8': draft.block_size is "
                                          r"already set by 'draft.block_size=2'; give each key once"):
        load_recipe(path, ["draft.block_size=2", "draft.block_size=8"])


@pytest.mark.parametrize("overrides", [
    ["train.loss.ce_weight=-1", "train.loss={ce_weight: 2}"],  # the mapping's 2 used to win silently
    ["train.loss.ce_weight=1", "train.loss={ce_weight: -5}"],  # -5 used to be blamed on the first
    ["train.loss={ce_weight: 2}", "train.loss.ce_weight=-1"],
    ["draft.block_size=4", "draft={block_size: 6}"],
])  # fmt: skip
def test_an_override_of_a_key_and_one_of_its_section_are_refused_naming_both(tmp_path, overrides):
    first, second = overrides
    section, key = sorted((first.split("=")[0], second.split("=")[0]), key=len)
    (problem,) = problems(write(tmp_path, BASE), overrides)
    assert problem == (f"command line {second!r}: {second.split('=')[0]} overlaps {first!r}, which "
                       f"sets {first.split('=')[0]}; give each key once, in one of the two")
    assert key.startswith(section + ".")
    # siblings do not overlap: both apply
    cfg = load_recipe(write(tmp_path, BASE, "b.yaml"), ["train.loss.ce_weight=2", "train.loss.decay=3"])
    assert (cfg.train.loss.ce_weight, cfg.train.loss.decay) == (2.0, 3.0)


def test_a_quoted_number_where_a_number_is_expected_says_to_drop_the_quotes(tmp_path):
    (problem,) = problems(write(tmp_path, BASE), ["train.zero_stage='2'"])
    assert "train.zero_stage: '2' is not one of 2, 3 (write it without quotes: 2)" in problem


def test_a_key_missing_from_a_section_an_override_created_is_located_at_the_override(tmp_path):
    path = write(tmp_path, "target:\n  model: random\n" + BASE.split("  num_key_value_heads: 2\n", 1)[1])
    found = problems(path, ["target.shape.hidden_size=64"])
    assert any(p.startswith("command line 'target.shape.hidden_size=64': target.shape.num_hidden_layers: "
                            "required key missing") for p in found), found


def test_bad_override_key(tmp_path):
    (problem,) = problems(write(tmp_path, BASE), ["draft.markov_rnk=8"])
    assert problem.startswith("command line 'draft.markov_rnk=8': draft.markov_rnk: unknown key")
    assert "did you mean 'markov_rank'?" in problem
    (problem,) = problems(write(tmp_path, BASE), ["drafter.block_size=8"])
    assert problem.startswith("command line 'drafter.block_size=8': drafter: unknown key")


def test_override_type_checked(tmp_path):
    (problem,) = problems(write(tmp_path, BASE), ["train.steps='8'"])
    assert problem == "command line \"train.steps='8'\": train.steps: expected int, got str '8'"
    (problem,) = problems(write(tmp_path, BASE), ["draft.block_size=1"])
    assert problem.startswith(
        "command line 'draft.block_size=1': draft.block_size: must be greater"
    )


def test_override_goes_through_cross_checks(tmp_path):
    (problem,) = problems(write(tmp_path, BASE), ["draft.target_layer_ids=[3]"])
    assert problem.startswith(
        "command line 'draft.target_layer_ids=[3]': draft.target_layer_ids[0]"
    )


def test_malformed_overrides(tmp_path):
    path = write(tmp_path, BASE)
    (problem,) = problems(path, ["draft.block_size"])
    assert problem == "command line 'draft.block_size': expected key.sub=value"
    (problem,) = problems(path, ["draft..block_size=3"])
    assert "empty key part" in problem
    (problem,) = problems(path, ["draft.block_size.x=3"])
    assert "draft.block_size is a value, not a section" in problem
    (problem,) = problems(path, ["draft.target_layer_ids=[1,"])
    assert "value is not valid YAML" in problem


# --------------------------------------------------------------------------- files


def test_file_level_errors(tmp_path):
    missing = tmp_path / "nope.yaml"
    assert problems(missing) == [f"{missing}: no such recipe file"]
    assert "the recipe is empty" in problems(write(tmp_path, "# nothing\n"))[0]
    (problem,) = problems(write(tmp_path, "- 1\n- 2\n"))
    assert problem.endswith(
        "r.yaml:1: the top level must be a mapping of sections "
        "(target, draft, data, split, train, eval, export), got list [1, 2]"
    )
    (problem,) = problems(write(tmp_path, "draft:\n  block_size: [1,\n  x: 2\n"))
    assert "r.yaml:" in problem and "YAML syntax error" in problem
    # an unclosed quote is found at the end of the file: the message names where it opened
    (problem,) = problems(write(tmp_path, 'train:\n  output_dir: "runs/x\n' + "# more\n" * 20))
    assert "YAML syntax error: while scanning a quoted scalar (line 2)" in problem, problem
    (problem,) = problems(write(tmp_path, "draft: 5\n"))
    assert problem.endswith("r.yaml:1: draft: expected a mapping of keys, got int 5")


# --------------------------------------------------------------------------- CLI


def test_config_show_prints_resolved_yaml(tmp_path, capsys):
    path = write(tmp_path, BASE)
    assert cli.main(["config", "show", str(path), "train.steps=7"]) == 0
    out = capsys.readouterr().out
    shown = yaml.safe_load(out)
    assert shown["train"]["steps"] == 7
    assert shown["draft"]["head_dim"] == 16
    assert shown["split"]["world_size"] == 2


def test_config_show_error_exit_code(tmp_path, capsys):
    path = write(tmp_path, replace("block_size", "block_siz: 4"))
    assert cli.main(["config", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:{LINE_OF['block_size']}: draft.block_siz: unknown key" in err
    assert "Traceback" not in err


def test_console_script_subprocess(tmp_path):
    bad = write(tmp_path, BASE, "bad.yaml")
    run = subprocess.run(
        [sys.executable, "-m", "draftforge", "config", "show", str(bad), "draft.nope=1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert "command line 'draft.nope=1': draft.nope: unknown key" in run.stderr
    assert "Traceback" not in run.stderr
    assert run.stdout == ""


def test_help_does_not_import_torch():
    code = (
        "import sys; from draftforge.cli import main; rc = main(['--help']); "
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', rc)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "config show" in run.stdout and "bench objective" in run.stdout
    assert run.stdout.strip().endswith("NO-TORCH 0")


def test_unknown_command(capsys):
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'; valid commands: bench, config" in capsys.readouterr().err
    assert cli.main(["config"]) == 2
    assert "config show" in capsys.readouterr().err


def test_bench_objective_delegates(monkeypatch):
    seen = []
    fake = types.ModuleType("draftforge.train.bench_objective")
    fake.main = lambda argv: seen.append(list(argv)) or 0
    monkeypatch.setitem(sys.modules, "draftforge.train.bench_objective", fake)
    assert cli.main(["bench", "objective", "--chunk", "64", "--help"]) == 0
    assert seen == [["--chunk", "64", "--help"]]


def test_a_local_target_folders_shape_is_recorded_so_the_run_reloads_without_it(tmp_path):
    """A recipe naming a local target folder and declaring no shape wrote `shape: null`: its
    run's config.yaml then failed to load (export, eval) where the folder is not."""
    import shutil

    import yaml
    from transformers import LlamaConfig

    from draftforge.config import load_recipe, validate_recipe

    folder = tmp_path / "target"
    LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=49152, max_position_embeddings=512,
                rope_theta=50000.0).save_pretrained(folder)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "target": {"model": str(folder)},
        "draft": {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "intermediate_size": 128, "target_layer_ids": [0, 1],
                  "block_size": 4, "mask_token_id": 16, "markov_rank": 8},
        "data": {"train_files": ["builtin:train-prompts"], "max_length": 96},
    }))
    cfg = load_recipe(recipe)
    assert cfg.target.shape.rope_theta == 50000.0 and cfg.draft.rope_theta == 50000.0
    saved = cfg.to_yaml()
    shutil.rmtree(folder)
    again = validate_recipe(yaml.safe_load(saved), source="config.yaml")
    assert again == cfg and again.target.shape.max_position_embeddings == 512
