"""Session 53: the target ranks of one job each decided whether the answers file was there, so a
'draftforge data regenerate' finishing while they started gave them two sources (one rank
answering inline, another reading the file). The launch's finding now decides for every rank."""

from __future__ import annotations

import pytest
from splitserve_helpers import tiny_recipe

from draftforge.config import load_recipe
from draftforge.errors import InputError
from draftforge.splitserve.producer import ANSWERS_SOURCE_ENV, load_source_conversations


def _recipe(tmp_path):
    cfg = load_recipe(tiny_recipe(tmp_path, overrides={"data.regenerate": True}))
    return cfg, tmp_path / "run" / "regenerated.jsonl"


def test_a_file_that_appears_after_the_launch_is_not_taken_by_the_jobs_ranks(tmp_path, monkeypatch):
    cfg, answers = _recipe(tmp_path)
    answers.parent.mkdir(parents=True)
    answers.write_text('{"id": "x", "messages": "not answers"}\n')  # a rank unpinned reads (and refuses) it
    with pytest.raises(Exception, match=str(answers)):
        load_source_conversations(cfg)
    monkeypatch.setenv(ANSWERS_SOURCE_ENV, "inline")
    conversations, regenerate = load_source_conversations(cfg)
    assert regenerate and len(conversations) == 48


def test_a_file_the_launch_found_and_that_is_gone_is_said(tmp_path, monkeypatch):
    cfg, answers = _recipe(tmp_path)
    assert load_source_conversations(cfg)[1]  # no file, unpinned: inline
    monkeypatch.setenv(ANSWERS_SOURCE_ENV, "file")
    with pytest.raises(InputError, match="the answers file this job's launch found is gone"):
        load_source_conversations(cfg)


def test_the_launcher_pins_what_it_found(tmp_path, monkeypatch):
    from draftforge.splitserve import launch

    recipe = tiny_recipe(tmp_path, overrides={"data.regenerate": True})
    seen = {}

    def ranks(command, *, env, **kwargs):
        seen.update(env)
        return 0

    monkeypatch.setattr(launch, "run_ranks", ranks)
    assert launch.main([str(recipe)]) == 0
    assert seen[ANSWERS_SOURCE_ENV] == "inline"
