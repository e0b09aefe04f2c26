"""A run directory under the home folder (``train.output_dir: ~/...``) is one folder for every
reader: the trainer wrote a literal ``./~/...`` while export, eval and the demo expand ``~``."""

from __future__ import annotations

from pathlib import Path

from draftforge.config import load_recipe
from draftforge.eval.demo import demo_paths

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"


def test_a_run_directory_under_home_is_the_home_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_recipe(RECIPE, ["train.output_dir=~/runs/r1"])
    assert cfg.train.output_dir == str(tmp_path / "runs" / "r1")
    paths = demo_paths(cfg)  # what the demo's export, eval and DFlash stages read
    assert paths.run_dir == tmp_path / "runs" / "r1"
    assert paths.export_dir == tmp_path / "runs" / "r1" / "export"
    assert paths.dflash_dir == tmp_path / "runs" / "r1-dflash"
    # a path without ~ is left as written (relative paths stay relative to the working folder)
    assert load_recipe(RECIPE, ["train.output_dir=runs/x~y"]).train.output_dir == "runs/x~y"
