"""Session 56: a finished run whose plot cannot be drawn is not started again and again for it;
the progress bar's and the summary's tokens/s are one figure; a checkpoint folder without its
COMPLETE marker is exported with a note saying so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

from dspark_helpers import tiny_draft
from test_export_r11 import _checkpoint as bare_checkpoint
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.cli import main
from draftforge.train import trainer as trainer_module
from draftforge.train.trainer import Trainer


def _trainer(run, steps=3):
    return Trainer(model_config=tiny_model_config(), embeddings=target_embeddings(), run_dir=run,
                   train=train_config(str(run), resume="auto", steps=steps, log_interval=2, checkpoint_interval=1))


def test_a_finished_run_whose_plot_cannot_be_drawn_starts_no_rank_again(tmp_path):
    """With matplotlib failing every time, each rerun of the finished run started every rank (the
    target loaded) to draw the missing plot, failed to, and left it missing for the next rerun."""
    from splitserve_helpers import tiny_recipe

    recipe = tiny_recipe(tmp_path, steps=2)
    broken = tmp_path / "broken" / "matplotlib"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("matplotlib is broken here")\n')
    run = tmp_path / "run"

    def train(*, plots: bool):
        env = dict(os.environ)
        if not plots:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(broken.parent), env.get("PYTHONPATH")]))
        done = subprocess.run([sys.executable, "-m", "draftforge", "train", str(recipe)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout + done.stderr

    first = train(plots=False)
    assert "could not draw" in first and "ImportError: matplotlib is broken here" in first, first[-2000:]
    again = train(plots=False)
    assert "[rank" not in again and "draftforge train: nothing to train: checkpoint" in again, again[-2000:]
    assert "records why as no_plot" in first
    summary = json.loads((run / "summary.json").read_text())
    assert summary["no_plot"] == "ImportError: matplotlib is broken here" and summary["steps_this_run"] == 2
    assert ("note: the run has no slot_acceptance.png: it could not be drawn (ImportError: matplotlib is "
            "broken here; summary.json: no_plot); to try again, remove summary.json and rerun") in again
    # the way out the note gives: the summary is rebuilt and the plot drawn
    (run / "summary.json").unlink()
    redrawn = train(plots=True)
    assert "[rank" in redrawn and (run / "slot_acceptance.png").read_bytes().startswith(b"\x89PNG")
    assert "no_plot" not in json.loads((run / "summary.json").read_text())


def test_a_plot_with_nothing_to_draw_is_recorded_and_a_rerun_of_the_run_is_nothing_to_train(tmp_path, capsys):
    """A finished run with no step of slot acceptance to draw (its log gone here) drew nothing and
    said nothing; the launcher's finished-run check, wanting the plot, started the ranks at every
    rerun."""
    from draftforge.splitserve.launch import Preflight, _finished_at

    run = tmp_path / "run"
    _trainer(run).fit([[s] for s in chain_samples(3)])
    kept = json.loads((run / "summary.json").read_text())
    (run / "slot_acceptance.png").unlink()
    (run / "metrics.jsonl").unlink()
    capsys.readouterr()
    again = _trainer(run)
    again.resume()
    again.fit([[s] for s in chain_samples(3)])
    out = capsys.readouterr().out
    assert "could not draw" in out and "no applied step with a per-slot acceptance" in out, out
    written = json.loads((run / "summary.json").read_text())
    assert written.pop("no_plot").startswith("no applied step with a per-slot acceptance")
    assert written == kept  # the run's own figures, not the rerun's 0 steps
    assert not (run / "slot_acceptance.png").exists()
    cfg = SimpleNamespace(split=SimpleNamespace(num_nodes=1), train=SimpleNamespace(output_dir=str(run), steps=3))
    said = _finished_at(cfg, Preflight(regenerate=False, resume_from=run / "checkpoints" / "step_00000003",
                                       resume_step=3))
    assert said is not None and said.startswith("draftforge train: nothing to train"), said
    assert "note: the run has no slot_acceptance.png: it could not be drawn (no applied step" in said


def test_the_bars_last_tokens_per_second_is_the_summarys(tmp_path, monkeypatch, capsys):
    """The bar counted from its own start to its last step, the summary to after the final
    checkpoint's save: a slow save (a large draft) printed two figures for one run."""
    import time

    bars = []

    class Bar(trainer_module.Progress):
        def __init__(self, **kwargs):
            super().__init__(**kwargs, enabled=False)
            bars.append(self)

    real_save = Trainer.save

    def slow_final_save(self, **kwargs):
        if self.step == self.train.steps:
            time.sleep(0.5)
        return real_save(self, **kwargs)

    monkeypatch.setattr(trainer_module, "Progress", Bar)
    monkeypatch.setattr(Trainer, "save", slow_final_save)
    run = tmp_path / "run"
    result = _trainer(run).fit([[s] for s in chain_samples(3)])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["tokens"] == bars[0].tokens == result.summary["tokens"] > 0
    assert summary["tokens_s"] == bars[0].tokens_s, (summary["tokens_s"], bars[0].tokens_s)
    assert summary["elapsed_s"] < 0.5  # the final save is not in it
    assert f"({summary['tokens_s']:.0f} tokens/s)" in capsys.readouterr().out


def test_a_checkpoint_folder_without_its_marker_exports_with_a_note(tmp_path, capsys):
    """A folder with model.safetensors and draft_config.json but no COMPLETE (a partial copy, an
    unfinished save) exported without a word, where train.resume refuses it."""
    folder = bare_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000004", tiny_draft(seed=3))
    assert main(["export", str(folder), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert (f"export: note: {folder} has no COMPLETE marker, which 'draftforge train' writes into a "
            "checkpoint last") in out, out
    assert "train.resume refuses it" in out and "so it is exported; if it came from a run, check that it " \
        "was copied whole, or pass the run directory" in out
    assert (tmp_path / "out" / "config.json").is_file()
    (folder / "COMPLETE").write_text("step 4\n")
    assert main(["export", str(folder / "model.safetensors"), "--out", str(tmp_path / "again")]) == 0
    assert "COMPLETE marker" not in capsys.readouterr().out


def test_evaluating_a_checkpoint_folder_without_its_marker_gets_the_same_note(tmp_path, capsys):
    from draftforge.eval.cli import _draft_loader

    folder = bare_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000004", tiny_draft(seed=3))
    cfg, _, _ = _draft_loader(str(folder))
    assert cfg.block_size == tiny_draft(seed=3).config.block_size
    out = capsys.readouterr().out
    assert out.startswith(f"eval: note: {folder} has no COMPLETE marker") and "so it is evaluated;" in out, out
    (folder / "COMPLETE").write_text("step 4\n")
    _draft_loader(str(folder))
    assert "COMPLETE" not in capsys.readouterr().out
