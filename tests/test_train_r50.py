"""Session 50: the run's records and its plot (a review of the observability outputs)."""

from __future__ import annotations

import math

from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.train.metrics import write_run_records
from draftforge.train.trainer import Trainer


def test_a_run_json_set_aside_does_not_let_a_later_recipe_overwrite_a_kept_one(tmp_path, capsys):
    """With run.json unreadable the segment count restarted at 0, so the next recipe change kept
    the old config.yaml under a name already taken (config.1.yaml) and the recipe it held was
    lost; a second damaged run.json replaced the first one set aside."""
    for recipe in ("name: a\n", "name: b\n"):
        write_run_records(tmp_path, recipe_yaml=recipe, details={})
    assert (tmp_path / "config.1.yaml").read_text() == "name: a\n"
    (tmp_path / "run.json").write_text("{broken")
    write_run_records(tmp_path, recipe_yaml="name: c\n", details={})
    write_run_records(tmp_path, recipe_yaml="name: d\n", details={})
    assert (tmp_path / "config.1.yaml").read_text() == "name: a\n"  # kept as it was
    kept = sorted(p.name for p in tmp_path.glob("config.*.yaml"))
    assert [(tmp_path / name).read_text() for name in kept].count("name: c\n") == 1
    (tmp_path / "run.json").write_text("[]")  # damaged again
    write_run_records(tmp_path, recipe_yaml="name: d\n", details={})
    assert (tmp_path / "run.json.unreadable").read_text() == "{broken"
    assert (tmp_path / "run.json.unreadable.2").read_text() == "[]"


def test_a_plot_that_fails_leaves_the_trained_run_whole_and_a_rerun_draws_it(tmp_path, monkeypatch, capsys):
    """Drawing after the summary was written raised out of a finished training (the summary not
    printed); the rerun then found summary.json, trained nothing and never drew the plot."""
    import draftforge.train.plots as plots

    def broken(path, **kwargs):
        raise RuntimeError("no font cache")

    real = plots.plot_slot_acceptance
    monkeypatch.setattr(plots, "plot_slot_acceptance", broken)
    settings = dict(steps=3, log_interval=2, checkpoint_interval=1)
    run = tmp_path / "run"

    def trainer():
        return Trainer(model_config=tiny_model_config(), embeddings=target_embeddings(), run_dir=run,
                       train=train_config(str(run), resume="auto", **settings))

    batches = [[s] for s in chain_samples(3)]
    first = trainer()
    first.fit(batches)
    out = capsys.readouterr().out
    assert "warning: could not draw" in out and "RuntimeError: no font cache" in out
    assert "training summary: step 3/3" in out and (run / "summary.json").exists()
    assert not (run / "slot_acceptance.png").exists()
    monkeypatch.setattr(plots, "plot_slot_acceptance", real)
    again = trainer()
    again.resume()
    again.fit(batches)
    assert (run / "slot_acceptance.png").stat().st_size > 0


def test_a_slot_without_data_is_no_bar_and_ends_the_line(tmp_path):
    """A slot no block reached (not a number) was drawn as acceptance 0, and the running product
    of every later slot with it."""
    from draftforge.train.plots import acceptance_title, plot_slot_acceptance

    assert acceptance_title([0.5, math.nan, 0.5], None) == "per-slot acceptance (1 + sum of the line = 1.500)"
    path = plot_slot_acceptance(tmp_path / "p.png", final=[0.5, math.nan], first=[0.25, None])
    assert path.read_bytes().startswith(b"\x89PNG")


def test_the_summary_says_which_steps_its_tau_is_the_mean_of():
    from draftforge.train.metrics import format_summary

    text = format_summary({"step": 1, "total_steps": 1, "steps_this_run": 1, "skipped_steps": 0,
                           "stopped_reason": "steps", "loss": 1.0, "tau": 1.5, "slot_acceptance": [0.5],
                           "tokens": 1, "elapsed_s": 1.0, "tokens_s": 1.0, "wait_s": 0.0,
                           "compute_s": 1.0, "checkpoint": None})
    assert "tau 1.500 (mean of the last train.log_interval applied steps)" in text


def test_the_bars_tokens_per_second_is_the_runs_so_far_not_the_last_steps(monkeypatch):
    """The bar showed the last step's tokens over its own wait and compute (jumping between 726
    and 1848 in a tiny run), where the summary divides the run's tokens by its wall time."""
    from draftforge.train import metrics

    clock = iter([100.0, 102.0, 104.0])  # start, after step 1, after step 2
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    bar = metrics.Progress(total=2, initial=0, enabled=False)
    bar.update(loss=1.0, tau=1.0, tokens=300)
    assert bar.tokens_s == 150.0
    bar.update(loss=1.0, tau=1.0, tokens=100)
    assert bar.tokens_s == 100.0  # 400 tokens in 4 s, not the last step's 50
