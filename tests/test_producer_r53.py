"""Session 53: the target ranks of one job each decided whether the answers file was there, so a
'draftforge data regenerate' finishing while they started gave them two sources (one rank
answering inline, another reading the file). On one node the launch's finding now decides for
every rank; the launch itself, the demo and anything the variable is inherited by look for
themselves (a review: the launcher read a pin left in its own environment)."""

from __future__ import annotations

import re

import pytest
from splitserve_helpers import tiny_recipe

from draftforge.config import load_recipe
from draftforge.data.regenerate import RegenerationError
from draftforge.errors import InputError
from draftforge.splitserve.launch import ANSWERS_SOURCE_ENV
from draftforge.splitserve.producer import launch_pin, load_source_conversations


def _recipe(tmp_path, **overrides):
    cfg = load_recipe(tiny_recipe(tmp_path, overrides={"data.regenerate": True, **overrides}))
    return cfg, tmp_path / "run" / "regenerated.jsonl"


def test_a_file_that_appears_after_the_launch_is_not_taken_by_the_jobs_ranks(tmp_path):
    cfg, answers = _recipe(tmp_path)
    answers.parent.mkdir(parents=True)
    answers.write_text('{"id": "x", "messages": "not answers"}\n')  # a rank unpinned reads (and refuses) it
    with pytest.raises(RegenerationError, match="^" + re.escape(f"{answers}, line 1: not a regenerated row (")):
        load_source_conversations(cfg)
    conversations, regenerate = load_source_conversations(cfg, pinned="inline")
    assert regenerate and len(conversations) == 48


def test_a_file_the_launch_found_and_that_is_gone_is_said(tmp_path):
    cfg, _ = _recipe(tmp_path)
    assert load_source_conversations(cfg)[1]  # no file, unpinned: inline
    with pytest.raises(InputError, match="the answers file this job's launch found is gone"):
        load_source_conversations(cfg, pinned="file")


def test_a_named_answers_file_that_is_missing_is_refused_even_when_pinned_inline(tmp_path):
    cfg, _ = _recipe(tmp_path, **{"data.regenerated_file": str(tmp_path / "named.jsonl")})
    with pytest.raises(InputError, match="data.regenerated_file .*no such file"):
        load_source_conversations(cfg, pinned="inline")


def test_the_launcher_pins_what_it_found_whatever_its_own_environment_says(tmp_path, monkeypatch):
    from draftforge.splitserve import launch

    recipe = tiny_recipe(tmp_path, overrides={"data.regenerate": True})
    seen = {}

    def ranks(command, *, env, **kwargs):
        seen.update(env)
        return 0

    monkeypatch.setattr(launch, "run_ranks", ranks)
    monkeypatch.setenv(ANSWERS_SOURCE_ENV, "file")  # left in the shell: not the launch's finding
    assert launch.main([str(recipe)]) == 0
    assert seen[ANSWERS_SOURCE_ENV] == "inline"
    assert ANSWERS_SOURCE_ENV not in launch.launch_env()  # nothing inherited reaches bench split's ranks
    monkeypatch.setenv(ANSWERS_SOURCE_ENV, "inline")
    assert launch_pin() == "inline"  # what a rank reads
