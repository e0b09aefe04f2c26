"""Review round 13 of the draft, the trainer and recipe loading: each test pins one fix."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from test_config import BASE

from draftforge.config import RecipeError, load_recipe

# A valid tiny recipe (test_config's, with a data section and steps); LINE counts its lines from 1.
RECIPE = BASE.replace("train:\n  strategy: single\n  lr: 1e-4\n",
                      "data:\n  max_length: 64\ntrain:\n  strategy: single\n  steps: 40\n")
LINE = {line.strip().split(":")[0]: n for n, line in enumerate(RECIPE.splitlines(), start=1)}


def write(tmp_path, text, name="r.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def problems(path, overrides=()):
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    return info.value.problems


# --------------------------------------------------------------------------- error locations


def test_a_mapping_override_is_blamed_only_for_the_keys_it_lists(tmp_path):
    """draft={block_size: 3} merges into the file's draft section: a bad layer id the file
    gives is the file's, at its line, not the override's."""
    path = write(tmp_path, RECIPE.replace("[0, 1, 2]", "[0, 1, 3]"))
    (problem,) = problems(path, ["draft={block_size: 3}"])
    assert problem.startswith(f"{path}:{LINE['target_layer_ids']}: draft.target_layer_ids[2]: layer id 3 "
                              "is the target's final layer"), problem
    # what the mapping lists is still the override's, at any depth
    (problem,) = problems(write(tmp_path, RECIPE, "ok.yaml"), ["draft={block_size: 1}"])
    assert problem == ("command line 'draft={block_size: 1}': draft.block_size: must be greater than "
                       "or equal to 2, got int 1")
    (problem,) = problems(write(tmp_path, RECIPE, "ok.yaml"), ["train={loss: {ce_wieght: 1}}"])
    assert problem.startswith("command line 'train={loss: {ce_wieght: 1}}': train.loss.ce_wieght: "
                              "unknown key (did you mean 'ce_weight'?)"), problem


def test_a_default_key_made_invalid_by_another_is_located_where_that_one_was_set(tmp_path):
    """train.warmup_ratio left at its default 0.04 is refused by train.steps=1: the message
    points at the override (or the file's steps line), not at the line 'train:'."""
    path = write(tmp_path, RECIPE)
    (problem,) = problems(path, ["train.steps=1"])
    assert problem.startswith("command line 'train.steps=1': train.warmup_ratio: 0.04 of 1 steps is 1 "
                              "warmup steps"), problem
    (problem,) = problems(write(tmp_path, RECIPE.replace("steps: 40", "steps: 1"), "one.yaml"))
    assert problem.startswith(f"{tmp_path / 'one.yaml'}:{LINE['steps']}: train.warmup_ratio: "), problem
    (problem,) = problems(path, ["data.max_length=8"])  # data.min_loss_tokens keeps its default 8
    assert problem.startswith("command line 'data.max_length=8': data.min_loss_tokens: 8 is not below "
                              "data.max_length 8"), problem
    # head_dim, derived from the file's hidden_size and the override's heads: the override
    (problem,) = problems(path, ["draft.num_attention_heads=64"])
    assert problem.startswith("command line 'draft.num_attention_heads=64': draft.head_dim: 1 is odd"), problem
    # the draft's default layer ids against a target the recipe gives: where the target is given
    no_ids = write(tmp_path, RECIPE.replace("  target_layer_ids: [0, 1, 2]\n", ""), "no_ids.yaml")
    found = problems(no_ids)
    assert found[0].startswith(f"{no_ids}:{LINE['num_hidden_layers']}: draft.target_layer_ids[1]: layer id 8 "
                               "is out of range: the target has 4 layers"), found
    # a key the recipe sets itself stays where it is set, with the override that brought the
    # problem about named beside it (session 55)
    explicit = write(tmp_path, RECIPE + "  warmup_ratio: 0.5\n", "explicit.yaml")
    (problem,) = problems(explicit, ["train.steps=1"])
    assert problem.startswith(f"{explicit}:{len(RECIPE.splitlines()) + 1} (with command line 'train.steps=1'): "
                              "train.warmup_ratio: 0.5 of 1 steps"), problem


# --------------------------------------------------------------------------- metrics


def test_a_step_with_no_supervised_slot_logs_no_loss_and_stays_out_of_the_summary(tmp_path):
    """A micro-batch whose samples have no two adjacent supervised tokens has no anchor: its
    objective is 0 over nothing. It used to be logged as loss 0.0 and pulled the summary's
    mean loss down (while its tau, not a number, was left out)."""
    import json
    import math
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

    from draftforge.train.sample import Sample
    from draftforge.train.trainer import Trainer

    samples = chain_samples(3)
    first = samples[0]
    unsupervised = Sample("none", first.input_ids, torch.zeros_like(first.loss_mask), first.aux,
                          first.final, {})
    trainer = Trainer(model_config=tiny_model_config(),
                      train=train_config(str(tmp_path), steps=4, log_interval=10),
                      embeddings=target_embeddings(), run_dir=tmp_path)
    result = trainer.fit([[unsupervised], *([s] for s in samples)])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    empty = records[0]
    assert empty["block_tokens"] == 0 and not empty["skipped"]
    assert [empty[k] for k in ("loss", "ce", "tv", "bce", "kl", "tau")] == [None] * 6
    trained = [r["loss"] for r in records[1:]]
    assert all(loss > 1.0 for loss in trained)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert math.isclose(summary["loss"], sum(trained) / 3, rel_tol=1e-12)
    assert math.isclose(result.summary["loss"], sum(trained) / 3, rel_tol=1e-12)


def test_the_readme_names_every_field_of_a_metrics_record_and_of_the_summary(tmp_path):
    """metrics.jsonl and summary.json are what a user plots and parses; the README said
    nothing of their fields (nor of slot_acceptance.png)."""
    import json
    import re
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

    from draftforge.train.trainer import Trainer

    trainer = Trainer(model_config=tiny_model_config(), train=train_config(str(tmp_path), steps=1),
                      embeddings=target_embeddings(), run_dir=tmp_path)
    trainer.fit([[s] for s in chain_samples(1)])
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    summary = json.loads((tmp_path / "summary.json").read_text())
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    found = re.search(r"What `draftforge train` writes in `train.output_dir`.*?\n\n", readme, re.S)
    assert found, "the README has no paragraph on what a training run writes"
    named = set(re.findall(r"`([a-z_./]+)`", found.group(0)))
    assert {"metrics.jsonl", "summary.json", "slot_acceptance.png"} <= named
    assert set(record) - named == set()
    assert set(summary) - named == set()
    assert {"steps_done", "data_exhausted", "max_bad_steps"} <= named  # every stopped_reason


# --------------------------------------------------------------------------- the Sample contract


@pytest.mark.parametrize(("ids_shape", "mask_shape", "message"), [
    ((), (), r"sample 'x': input_ids must be 1-D, got \(\)"),  # was an IndexError
    ((4,), (4, 1), r"sample 'x': loss_mask must be 1-D, got \(4, 1\)"),  # was accepted, then collate failed
])  # fmt: skip
def test_a_sample_whose_ids_or_loss_mask_are_not_1d_is_refused_naming_them(ids_shape, mask_shape, message):
    import torch

    from draftforge.train.sample import Sample, collate

    with pytest.raises(ValueError, match=message):
        sample = Sample("x", torch.zeros(ids_shape, dtype=torch.long), torch.ones(mask_shape, dtype=torch.bool),
                        torch.zeros(4, 2), torch.zeros(4, 2))
        collate([sample])


def test_a_value_that_fits_no_member_of_a_union_is_one_problem_naming_every_member(tmp_path):
    """train.loss.compile is a bool or 'auto': a bad value used to give two contradicting
    lines for the one key ('expected bool' and 'is not one of 'auto'')."""
    assert problems(write(tmp_path, RECIPE), ["train.loss.compile=maybe"]) == [
        "command line 'train.loss.compile=maybe': train.loss.compile: expected bool or 'auto', got str 'maybe'"]
    path = write(tmp_path, RECIPE + "  loss:\n    compile: 0\n", "file.yaml")
    assert problems(path) == [
        f"{path}:{len(RECIPE.splitlines()) + 2}: train.loss.compile: expected bool or 'auto', got int 0"]
    for text, value in (("auto", "auto"), ("true", True), ("false", False)):
        assert load_recipe(write(tmp_path, RECIPE, "ok.yaml"), [f"train.loss.compile={text}"]).train.loss.compile == value
