"""Dry runs of the production recipes work on a CPU machine without the targets' weights."""

from pathlib import Path

import pytest

from draftforge.splitserve.launch import main as train_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("recipe", "expected"),
    [
        # The published Ling-3.0-flash-dspark parameter count (model card), embeddings included.
        ("recipes/ling3-flash-dspark.yaml", "draft parameters: 1,363,707,905 with embeddings"),
        ("recipes/qwen3-8b-dspark.yaml", "draft parameters:"),
    ],
)
def test_production_recipe_dry_run(recipe, expected, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert train_main([recipe, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert expected in out
    assert "memory estimate per trainer rank" in out and "memory estimate per target rank" in out
    assert "world size 8; comm backend nccl" in out
