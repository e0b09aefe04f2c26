"""Session 51: redrawing a missing plot keeps the finished run's summary."""

from __future__ import annotations

import json

from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.train.trainer import Trainer


def three_step_trainer(run):
    """A trainer of a 3-step run in ``run`` that resumes there, and its batches: one finished
    by ``fit``, to be run again by another."""
    trainer = Trainer(model_config=tiny_model_config(), embeddings=target_embeddings(), run_dir=run,
                      train=train_config(str(run), resume="auto", steps=3, log_interval=2, checkpoint_interval=1))
    return trainer, [[s] for s in chain_samples(3)]


def test_a_rerun_that_redraws_a_missing_plot_keeps_the_summary(tmp_path, capsys):
    """The rerun that draws a plot missing from a finished run (its drawing failed, or it was
    deleted) also wrote summary.json with its own figures: 0 steps, 0 tokens, 0 tokens/s."""
    run = tmp_path / "run"
    first, batches = three_step_trainer(run)
    first.fit(batches)
    before = (run / "summary.json").read_text()
    assert json.loads(before)["steps_this_run"] == 3 and json.loads(before)["tokens"] > 0
    plot = run / "slot_acceptance.png"
    drawn = plot.read_bytes()
    plot.unlink()
    capsys.readouterr()
    again, _ = three_step_trainer(run)
    again.resume()
    again.fit(batches)
    assert (run / "summary.json").read_text() == before
    assert plot.read_bytes().startswith(b"\x89PNG") and len(plot.read_bytes()) > 0
    assert drawn.startswith(b"\x89PNG")
    # nothing trained, so no summary of this run's (empty) work is printed
    assert "training summary" not in capsys.readouterr().out
