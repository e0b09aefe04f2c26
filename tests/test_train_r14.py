"""Review round 14 of the trainer, the Markov init, recipe loading and the draft: each test pins one fix."""

from __future__ import annotations

import json

import pytest
import torch
from test_train_r13 import RECIPE as R13_RECIPE
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.train.sample import Sample
from draftforge.train.trainer import Trainer

# --------------------------------------------------------------------------- a step without anchors


def _unsupervised(sample: Sample) -> Sample:
    return Sample("none", sample.input_ids, torch.zeros_like(sample.loss_mask), sample.aux, sample.final, {})


def _snapshot(trainer: Trainer) -> tuple[dict, dict]:
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    moments = {id(p): {k: v.clone() for k, v in state.items()} for p, state in trainer.optimizer.state.items()}
    return weights, moments


def test_a_step_without_any_supervised_slot_moves_no_weight_and_resumes_exactly(tmp_path):
    """A step whose samples have no anchor has a zero gradient; it still ran optimizer.step(),
    and AdamW's momentum (from the step before) and weight decay moved every weight. Such a
    step must leave weights and AdamW moments as they were, keep its place in the schedule,
    count its samples as consumed, and not be counted as a skipped (non-finite) step."""
    samples = chain_samples(3)
    batches = [[samples[0]], [_unsupervised(samples[1])], [samples[2]]]
    config = dict(steps=3, log_interval=10, weight_decay=0.1, checkpoint_interval=100)

    trainer = Trainer(model_config=tiny_model_config(), train=train_config(str(tmp_path / "full"), **config),
                      embeddings=target_embeddings(), run_dir=tmp_path / "full")
    snapshots = []
    result = trainer.fit(batches, on_step=lambda record: snapshots.append(_snapshot(trainer)))
    (w1, m1), (w2, m2), (w3, _) = snapshots
    assert result.step == 3 and result.skipped_steps == 0 and result.stopped_reason == "steps_done"
    for name, value in w1.items():
        assert torch.equal(value, w2[name]), name
    assert m1.keys() == m2.keys() and m1
    for key, state in m1.items():
        for part, value in state.items():
            assert torch.equal(value, m2[key][part]), part  # exp_avg, exp_avg_sq and AdamW's step
    assert any(not torch.equal(w2[k], w3[k]) for k in w2)  # the next supervised step learns
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    empty = records[1]
    assert (empty["step"], empty["block_tokens"], empty["grad_norm"], empty["skipped"],
            empty["skipped_steps"]) == (2, 0, 0.0, False, 0)
    assert trainer.consumed_ids == ["s0000", "none", "s0002"]

    # Exact resume across it: stop after the empty step (data runs out), resume with the rest.
    cut = Trainer(model_config=tiny_model_config(), train=train_config(str(tmp_path / "cut"), **config),
                  embeddings=target_embeddings(), run_dir=tmp_path / "cut")
    assert cut.fit(batches[:2]).stopped_reason == "data_exhausted"
    resumed = Trainer(model_config=tiny_model_config(),
                      train=train_config(str(tmp_path / "cut"), **{**config, "resume": "auto"}),
                      embeddings=target_embeddings(), run_dir=tmp_path / "cut")
    info = resumed.resume()
    assert info.step == 2 and info.consumed_ids == ["s0000", "none"]
    rest = resumed.fit(batches[2:])
    assert rest.losses == result.losses[2:]  # bit-exact
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, w3[name]), name


DEEPSPEED_NO_ANCHOR = """
import os, sys
from pathlib import Path
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1)
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config
from draftforge.train.sample import Sample
from draftforge.train.trainer import Trainer
run = Path(sys.argv[1])
trainer = Trainer(model_config=tiny_model_config(), train=train_config(output_dir=str(run), strategy="deepspeed",
                  zero_stage=2, steps=3, weight_decay=0.1, max_bad_steps=0), embeddings=target_embeddings(),
                  run_dir=run, recipe_yaml="name: t\\n", group=dist.group.WORLD)
s = chain_samples(3)
none = Sample("none", s[1].input_ids, torch.zeros_like(s[1].loss_mask), s[1].aux, s[1].final, {})
weights = []
result = trainer.fit([[s[0]], [none], [s[2]]], on_step=lambda r: weights.append(trainer.full_state_dict()))
same = all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
moved = any(not torch.equal(weights[1][k], weights[2][k]) for k in weights[1])
print("RESULT", result.stopped_reason, result.skipped_steps, result.step, same, moved)
dist.destroy_process_group()
from trainer_helpers import leave_at_once
leave_at_once()
"""


def test_deepspeed_drops_the_update_of_a_step_without_any_supervised_slot(tmp_path):
    """DeepSpeed steps inside engine.step(): a step without anchors must be dropped there too
    (not counted as a bad step, so max_bad_steps=0 does not stop the run)."""
    pytest.importorskip("deepspeed")
    from splitserve_helpers import run_script_rank

    stdout = run_script_rank(DEEPSPEED_NO_ANCHOR, tmp_path, "ds_none.py")
    assert "RESULT steps_done 0 3 True True" in stdout, stdout[-2000:]


# --------------------------------------------------------------------------- a bigram table of zeros


@pytest.mark.parametrize("head_type", ["vanilla", "gated"])
def test_a_bigram_table_that_centres_to_zero_is_reported_and_leaves_a_head_that_learns(head_type):
    """One distinct next token: the centred table is all zeros. The log said "nan% of the
    table's energy" and the rank-1 'table' zeroed a column of both factors (dead for good)."""
    from dspark_helpers import tiny_draft

    from draftforge.train.markov_init import bigram_scores, init_markov_bigram

    sequences = [[1, 2, 2, 2, 2], [2, 2, 2]]  # every next token is 2
    _, cols, scores = bigram_scores(sequences)
    assert cols.tolist() == [2] and torch.count_nonzero(scores) == 0
    model = tiny_draft(markov_rank=8, markov_head_type=head_type)
    w1 = model.markov_head.markov_w1.weight.detach().clone()
    message = init_markov_bigram(model, sequences)
    assert message == ("markov head initialised as a bigram of the training answers: 1 previous x 1 next "
                       "tokens, whose centred table is all zeros (every previous token predicts the same "
                       "next tokens): the head starts with no correction")
    head = model.markov_head
    assert torch.count_nonzero(head.markov_w2.weight) == 0
    assert torch.equal(head.markov_w1.weight, w1)  # every column random: each one learns
    if head_type == "gated":  # as for a table that is not zero: the gate starts at exactly 1/2
        assert torch.count_nonzero(head.gate_proj.weight) == 0 and torch.count_nonzero(head.gate_proj.bias) == 0


# --------------------------------------------------------------------------- empty section overrides

RECIPE = R13_RECIPE + "  loss:\n    ce_weight: 0.5\n    decay: 2.0\n"


@pytest.mark.parametrize("override", ["train.loss=", "train.loss=null", "train.loss=~"])
def test_an_empty_section_on_the_command_line_means_all_defaults_as_in_the_file(tmp_path, override):
    """'loss:' with nothing under it in a file means all defaults; train.loss= on the command
    line was refused ("expected a mapping of keys, got null")."""
    from draftforge.config import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(RECIPE)
    empty = tmp_path / "empty.yaml"
    empty.write_text(RECIPE.replace("    ce_weight: 0.5\n    decay: 2.0\n", ""))
    from_file = load_recipe(empty).train.loss.model_dump()
    assert (from_file["ce_weight"], from_file["decay"]) != (0.5, 2.0)  # the recipe's differ
    assert load_recipe(path, ["train.loss={}"]).train.loss.ce_weight == 0.5  # a mapping merges
    cfg = load_recipe(path, [override])
    assert cfg.train.loss.model_dump() == from_file
    assert cfg.train.steps == 40  # the rest of train is the recipe's


# --------------------------------------------------------------------------- merge keys

MERGED = RECIPE.replace("train:\n", "x-loss: &loss\n  ce_weight: 0.5\n  decay: -1.0\n  tv_weight: -2.0\n"
                        "x-train: &train\n  lr: -1.0\n  loss:\n    kl_weight: -3.0\n"
                        "train:\n").replace(
    "  loss:\n    ce_weight: 0.5\n    decay: 2.0\n",
    "  <<: *train\n  loss:\n    <<: *loss\n    tv_weight: -0.5\n")


def test_a_key_brought_in_by_a_merge_is_located_at_the_merge(tmp_path):
    """A bad value under `<<: *anchor` was located at the line of the mapping holding the merge
    (`loss:`), neither at the merge nor at the value; it is at the merge line now (the anchor
    may be merged in several places). An explicit key beside the merge keeps its own line, and
    one that replaces a merged section (loss beside `<<: *train`) takes that section's keys with it."""
    from draftforge.config import RecipeError, load_recipe

    path = tmp_path / "m.yaml"
    path.write_text(MERGED)
    line = {text: n for n, text in enumerate(MERGED.splitlines(), start=1)}
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    found = info.value.problems
    assert f"{path}:{line['  <<: *train']}: train.lr: must be greater than 0, got float -1.0" in found, found
    assert f"{path}:{line['    <<: *loss']}: train.loss.decay: must be greater than 0, got float -1.0" in found, found
    assert f"{path}:{line['    tv_weight: -0.5']}: train.loss.tv_weight: must be greater than or equal to 0, " \
        "got float -0.5" in found, found  # the explicit key wins over the merged -2.0
    assert not any("-2.0" in p or "kl_weight" in p for p in found), found  # replaced: not validated
    # the anchors' own sections are still checked where they are
    assert f"{path}:{line['x-loss: &loss']}: x-loss: unknown key" in " ".join(found), found


# --------------------------------------------------------------------------- aux width


def test_target_features_of_another_width_are_refused_with_both_widths(tmp_path):
    """Features captured with two target layers (or from another target) for a draft that
    reads three failed deep in training with torch's 'mat1 and mat2 shapes cannot be multiplied'."""
    from draftforge.train.model import DSparkDraft

    cfg = tiny_model_config()
    expected = ("the target features (aux) have 64 values per position, the draft expects 96: 3 target "
                "layers [0, 2, 4] x the target's hidden size 32; were they captured from another target "
                "or with other draft.target_layer_ids?")
    assert cfg.num_context_features == 3 * 32
    draft = DSparkDraft(cfg)
    with pytest.raises(ValueError) as info:
        draft.context_kv(torch.randn(1, 5, 2 * 32))  # inference
    assert str(info.value) == expected
    sample = chain_samples(1)[0]
    narrow = Sample("narrow", sample.input_ids, sample.loss_mask, sample.aux[:, :64], sample.final, {})
    trainer = Trainer(model_config=cfg, train=train_config(str(tmp_path), steps=1), embeddings=target_embeddings(),
                      run_dir=tmp_path)
    with pytest.raises(ValueError) as info:  # training
        trainer.train_step([[narrow]])
    assert str(info.value) == expected
    narrow = Sample("narrow", sample.input_ids, sample.loss_mask, sample.aux, sample.final[:, :16], {})
    with pytest.raises(ValueError) as info:  # the final states, the objective's target
        trainer.train_step([[narrow]])
    assert str(info.value) == ("the target's final hidden states have 16 values per position, the draft "
                               "expects the target's hidden size 32; were they captured from another target?")


# --------------------------------------------------------------------------- the plot's first steps


def test_the_plots_first_steps_are_those_of_the_first_step_that_supervised_anything(tmp_path, monkeypatch):
    """A run whose first step had no anchor drew that step's slots (all not-a-number) as the
    'first steps' bars, at 0: the plot showed the draft starting at zero acceptance. The same
    for a resumed run, which takes them from the logged steps."""
    import math

    import draftforge.train.plots as plots

    drawn = []
    monkeypatch.setattr(plots, "plot_slot_acceptance", lambda path, **kw: drawn.append(kw["first"]))
    samples = chain_samples(4)
    batches = [[_unsupervised(samples[0])], *([s] for s in samples[1:])]
    config = dict(steps=4, log_interval=10, checkpoint_interval=100)
    trainer = Trainer(model_config=tiny_model_config(), train=train_config(str(tmp_path / "full"), **config),
                      embeddings=target_embeddings(), run_dir=tmp_path / "full")
    trainer.fit(batches)
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["block_tokens"] == 0 and records[1]["block_tokens"] > 0
    expected = records[1]["slot_acceptance"]
    assert all(not math.isnan(v) for v in drawn[0]) and drawn[0] == pytest.approx(expected, rel=1e-12)

    cut = Trainer(model_config=tiny_model_config(), train=train_config(str(tmp_path / "cut"), **config),
                  embeddings=target_embeddings(), run_dir=tmp_path / "cut")
    cut.fit(batches[:2])
    resumed = Trainer(model_config=tiny_model_config(),
                      train=train_config(str(tmp_path / "cut"), **{**config, "resume": "auto"}),
                      embeddings=target_embeddings(), run_dir=tmp_path / "cut")
    resumed.resume()
    resumed.fit(batches[2:])
    assert drawn[-1] == pytest.approx(expected, rel=1e-12)
