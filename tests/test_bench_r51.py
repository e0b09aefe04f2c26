"""Session 51: bench split says what its scratch run folder changes about the recipe."""

from __future__ import annotations

import pytest
from splitserve_helpers import tiny_recipe
from test_cli_r15 import _run as draftforge_run

from draftforge.splitserve import supervisor


def _run(argv, capsys, monkeypatch):
    started = []

    def fake_ranks(command, **kwargs):
        started.append(command)
        return 3  # the job failed: no result to report

    monkeypatch.setattr(supervisor, "run_ranks", fake_ranks)
    code, _, err = draftforge_run(argv, capsys)
    return code, err, started


@pytest.fixture
def answered(tmp_path):
    """A regenerating recipe whose run folder holds answers, as after 'draftforge data regenerate'."""
    recipe = tiny_recipe(tmp_path, overrides={"data.regenerate": True})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "regenerated.jsonl").write_text("")
    return recipe, tmp_path / "run" / "regenerated.jsonl"


def test_answers_train_would_read_are_named_not_silently_skipped(answered, capsys, monkeypatch):
    """The benchmark's scratch run folder moved data.regenerated_file's default, so answers that
    'draftforge train' reads were not, and the target answered inline without a word."""
    recipe, answers = answered
    code, err, started = _run(["bench", "split", str(recipe), "--steps", "2"], capsys, monkeypatch)
    assert code == 3 and started
    assert (f"where 'draftforge train' would read {answers}; add data.regenerated_file={answers} "
            "to measure that") in err


def test_a_bigram_start_without_answers_is_refused_before_the_job(answered, capsys, monkeypatch):
    """The trainer rank refused it after the target had loaded, advising 'draftforge data
    regenerate', which had been run: the benchmark's own folder was the reason."""
    recipe, answers = answered
    code, err, started = _run(["bench", "split", str(recipe), "train.markov_init=bigram"], capsys, monkeypatch)
    assert code == 2 and not started
    assert f"pass data.regenerated_file={answers}" in err


def test_overrides_of_the_benchmarks_own_keys_are_said_unused(tmp_path, capsys, monkeypatch):
    recipe = tiny_recipe(tmp_path)
    code, err, _ = _run(["bench", "split", str(recipe), f"train.output_dir={tmp_path / 'mine'}"], capsys, monkeypatch)
    assert code == 3
    assert f"train.output_dir={tmp_path / 'mine'}: not used, the benchmark trains in a scratch run folder" in err
