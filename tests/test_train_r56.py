"""Session 56: what a resumed or extended run said about itself, and how --nproc is refused."""

from __future__ import annotations

import json
from pathlib import Path

from test_cli_r15 import _run
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.train import checkpoint as ckpt
from draftforge.train.sample import pack
from draftforge.train.trainer import Trainer, lr_at

ROOT = Path(__file__).resolve().parents[1]


def _trainer(run: Path, **overrides) -> Trainer:
    return Trainer(model_config=tiny_model_config(), train=train_config(str(run), **overrides),
                   embeddings=target_embeddings(), run_dir=run, recipe_yaml="name: test\n")


def _finished(run: Path) -> dict:
    """A 4-step run trained to its end in ``run``; its summary."""
    assert _trainer(run, steps=4).fit(pack(chain_samples(20), 90)[:4]).stopped_reason == "steps_done"
    return json.loads((run / "summary.json").read_text())


def test_a_segment_that_trains_nothing_leaves_a_summary_of_the_run_as_it_is_now(tmp_path):
    """Extended to 8 steps with its data used up, the rerun stopped at once (data_exhausted, 0
    steps) and left the earlier segment's summary: step 4/4, steps_done, 4 steps this run."""
    run = tmp_path / "run"
    first = _finished(run)
    assert (first["step"], first["total_steps"], first["stopped_reason"]) == (4, 4, "steps_done")
    longer = _trainer(run, steps=8, resume="auto")
    longer.resume()
    result = longer.fit([])
    assert (result.steps_run, result.stopped_reason) == (0, "data_exhausted")
    now = json.loads((run / "summary.json").read_text())
    assert (now["step"], now["total_steps"], now["steps_this_run"], now["stopped_reason"]) == (
        4, 8, 0, "data_exhausted")
    assert now["checkpoint"] == str(ckpt.checkpoint_path(run, 4)) == first["checkpoint"]
    # the trained steps' figures, from metrics.jsonl, and said so
    assert now["rebuilt_from"] == "metrics.jsonl" and now["tokens"] == first["tokens"]
    for key in ("loss", "tau", "slot_acceptance"):
        assert now[key] == first[key], key


def test_extending_a_finished_run_notes_that_its_schedule_had_ended(tmp_path):
    """The note compared step 5's new rate with the finished 4-step schedule's at step 5, "would
    have been 0.000e+00": a step that schedule never had."""
    run = tmp_path / "run"
    _finished(run)
    old = train_config(steps=4)
    end = lr_at(4, train=old)
    assert end == 0.0  # the cosine's end (min_lr_ratio 0)
    new = train_config(steps=8)  # warmup_ratio 0.1: 1 warmup step
    note = _trainer(run, steps=8, resume="auto").resume().schedule_change
    # steps counted from 1: step n trains at lr_at(n - 1), so a run's last step trains above the
    # cosine's end (a review found the note giving the end value as the rate of steps 4 and 8)
    assert note == (
        f"the checkpointed run had finished its learning-rate schedule (train.steps 4): its last step "
        f"trained at {lr_at(3, train=old):.3e}, its cosine ending at {end:.3e}; under this recipe's "
        f"schedule (train.lr 0.003, steps 8, warmup_ratio 0.1, min_lr_ratio 0) step 5 trains at "
        f"{lr_at(4, train=new):.3e}, with no warmup again (its warmup ended at step 1), and the rate "
        f"follows the cosine down to {lr_at(7, train=new):.3e} at step 8, its last (the cosine ends at "
        "0.000e+00)")
    assert lr_at(3, train=old) > 0 and lr_at(7, train=new) > 0
    # a warmup longer than the finished run goes on from the resumed step, it does not restart
    new = train_config(steps=40, warmup_ratio=0.25)  # 10 warmup steps
    note = _trainer(run, steps=40, warmup_ratio=0.25, resume="auto").resume().schedule_change
    assert lr_at(4, train=new) == 5 / 10 * new.lr
    assert (f"step 5 trains at {lr_at(4, train=new):.3e}, within its warmup: the rate rises to "
            f"{new.lr:.3e} at step 10 (the warmup goes on from step 5, it does not start again), then "
            f"follows the cosine down to {lr_at(39, train=new):.3e} at step 40, its last") in note
    assert "would have been" not in note


def test_a_wrong_nproc_is_an_option_error_not_an_invalid_recipe(monkeypatch, capsys):
    """Headed "invalid recipe:", as if the recipe were at fault; --node-rank's and --master-addr's
    own errors are headed "error:"."""
    monkeypatch.chdir(ROOT)
    started = []
    monkeypatch.setattr("draftforge.splitserve.launch.run_ranks", lambda *a, **k: started.append(a) or 0)
    for dry in (["--dry-run"], []):
        code, out, err = _run(["train", "recipes/tiny-debug.yaml", "--nproc", "3", *dry], capsys)
        assert code == 2 and not out
        assert err == (
            "draftforge train: error: --nproc 3: processes on this node: split.world_size / "
            "split.num_nodes = 2 / 1 = 2 (target ranks [0], trainer ranks [1]); pass --nproc 2, drop "
            "--nproc or change the split (e.g. split.world_size=N)\n"), err
    assert not started
