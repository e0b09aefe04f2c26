"""A run directory's records: one run.json segment per training segment, each earlier recipe
kept, and a git revision only for draftforge's own source tree."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from draftforge.train import metrics
from draftforge.train.metrics import git_revision, write_run_records


def _segment(run_dir, monkeypatch, recipe_yaml, *argv, revision="abc"):
    monkeypatch.setattr(sys, "argv", ["draftforge", "train", *argv])
    monkeypatch.setattr(metrics, "git_revision", lambda: revision)
    write_run_records(run_dir, recipe_yaml=recipe_yaml, details={"strategy": "single"})
    return json.loads((run_dir / "run.json").read_text())["segments"]


def test_each_segment_keeps_its_command_revision_and_recipe(tmp_path, monkeypatch):
    first = _segment(tmp_path, monkeypatch, "a: 1\n", "r.yaml", revision="rev1")
    assert len(first) == 1 and first[0]["config"] == "config.yaml"
    second = _segment(tmp_path, monkeypatch, "a: 2\n", "r.yaml", "a=2", revision="rev2")
    assert second[0] == {**first[0], "config": "config.1.yaml"}  # only where its recipe now is
    assert second[0]["command"][1:] == ["draftforge", "train", "r.yaml"]
    assert second[1]["command"][1:] == ["draftforge", "train", "r.yaml", "a=2"]
    assert [s["git_revision"] for s in second] == ["rev1", "rev2"]
    assert [s["strategy"] for s in second] == ["single", "single"]
    assert (tmp_path / "config.1.yaml").read_text() == "a: 1\n"
    assert (tmp_path / "config.yaml").read_text() == "a: 2\n"
    # the same recipe again: nothing more to keep
    third = _segment(tmp_path, monkeypatch, "a: 2\n", "r.yaml", "a=2")
    assert [s["config"] for s in third] == ["config.1.yaml", "config.yaml", "config.yaml"]
    # another: the recipe of segments 2 and 3 is named after the first of them
    fourth = _segment(tmp_path, monkeypatch, "a: 3\n", "r.yaml", "a=3")
    assert [s["config"] for s in fourth] == ["config.1.yaml", "config.2.yaml", "config.2.yaml",
                                             "config.yaml"]
    assert {p.name: p.read_text() for p in tmp_path.glob("config*.yaml")} == {
        "config.1.yaml": "a: 1\n", "config.2.yaml": "a: 2\n", "config.yaml": "a: 3\n"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.1.yaml", "config.2.yaml", "config.yaml", "run.json"]  # no temporary left


def test_a_run_json_without_segments_becomes_the_first(tmp_path, monkeypatch):
    old = {"command": ["python", "old"], "started": "2024-01-01T00:00:00+00:00", "strategy": "fsdp2"}
    (tmp_path / "run.json").write_text(json.dumps(old))
    (tmp_path / "config.yaml").write_text("a: 1\n")
    segments = _segment(tmp_path, monkeypatch, "a: 2\n", "r.yaml")
    assert segments[0] == {**old, "config": "config.1.yaml"} and len(segments) == 2
    assert (tmp_path / "config.1.yaml").read_text() == "a: 1\n"


def test_an_unreadable_run_json_is_kept_aside(tmp_path, monkeypatch, capsys):
    (tmp_path / "run.json").write_text('{"segments": [')
    segments = _segment(tmp_path, monkeypatch, "a: 1\n", "r.yaml")
    assert len(segments) == 1
    assert (tmp_path / "run.json.unreadable").read_text() == '{"segments": ['
    assert "run.json.unreadable" in capsys.readouterr().out


def _git(cwd, *args) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                          cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _repo(path, project_name):
    path.mkdir(parents=True)
    (path / "pyproject.toml").write_text(f'[project]\nname = "{project_name}"\nversion = "1"\n')
    _git(path, "init", "-q")
    _git(path, "add", "pyproject.toml")
    _git(path, "commit", "-q", "-m", "first")
    return _git(path, "rev-parse", "HEAD")


@pytest.mark.skipif(subprocess.run(["git", "--version"], capture_output=True).returncode != 0,
                    reason="needs git")
def test_git_revision_is_only_draftforges_own(tmp_path):
    # draftforge installed (not editable) in a virtual environment inside the user's repository
    _repo(tmp_path / "user", "users-project")
    installed = tmp_path / "user" / ".venv" / "lib" / "site-packages" / "draftforge"
    (installed / "train").mkdir(parents=True)
    assert git_revision(installed) is None
    # a copy of draftforge's source committed inside the user's repository: not its own tree
    vendored = tmp_path / "user" / "vendor" / "draftforge"
    (vendored / "train").mkdir(parents=True)
    (vendored / "pyproject.toml").write_text('[project]\nname = "draftforge"\n')
    assert git_revision(vendored) is None
    # draftforge's own checkout (an editable install)
    source = tmp_path / "draftforge"
    head = _repo(source, "draftforge")
    assert git_revision(source) == head
    (source / "pyproject.toml").write_text('[project]\nname = "draftforge"\nversion = "2"\n')
    assert git_revision(source) == head + "-dirty"


def test_git_revision_default_is_the_tree_this_module_runs_from():
    from pathlib import Path

    root = Path(metrics.__file__).resolve().parent.parent
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True,
                         text=True)
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root:
        assert git_revision() is None
        return
    head = _git(root, "rev-parse", "HEAD")
    assert git_revision() in (head, head + "-dirty")
