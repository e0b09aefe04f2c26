"""Review round 49 of ``draftforge demo``: a recipe that trains on data.train_files as they are
(no regeneration) had no record of what its runs trained on, so a file edited since left the
finished runs in place and the demo evaluated them as if trained on it."""

from __future__ import annotations

import json

from splitserve_helpers import tiny_recipe
from test_demo_r25 import _stubbed_stages

from draftforge.config import load_recipe
from draftforge.eval import demo, demo_state


def test_a_train_file_edited_since_the_trainings_is_refused(tmp_path, monkeypatch, capsys):
    recipe = tiny_recipe(tmp_path, steps=4, overrides={"eval.workloads": ["humaneval"]})
    cfg = load_recipe(recipe)
    assert not cfg.data.regenerate
    paths = demo.demo_paths(cfg)
    ran, _ = _stubbed_stages(monkeypatch, recipe, paths)
    assert demo.main([str(recipe), "--num-prompts", "8"]) == 0
    assert ran[:2] == ["train DSpark", "train DFlash"]
    stamps = [json.loads((run / demo_state.ANSWERS_STAMP).read_text())["sha256"]
              for run in (paths.run_dir, paths.dflash_dir)]
    assert stamps[0] == stamps[1] == demo_state.answers_digest(paths, cfg)
    # unchanged: nothing to do
    ran.clear()
    assert demo.main([str(recipe), "--num-prompts", "8"]) == 0
    assert ran == []
    capsys.readouterr()

    train_file = demo_state.Path(cfg.data.train_files[0])
    lines = train_file.read_text().splitlines(keepends=True)
    train_file.write_text("".join(lines[1:] + lines[:1]))  # the same conversations, another order
    for extra in ([], ["--skip-train"]):
        assert demo.main([str(recipe), "--num-prompts", "8", *extra]) == 2
        err = capsys.readouterr().err
        assert (f"{paths.run_dir}: the DSpark draft was trained on other conversations than "
                "data.train_files hold now") in err, err
    assert ran == []
    # --force trains again on the file as it is now
    assert demo.main([str(recipe), "--num-prompts", "8", "--force"]) == 0
    assert ran[:2] == ["train DSpark", "train DFlash"]
    assert json.loads((paths.run_dir / demo_state.ANSWERS_STAMP).read_text())["sha256"] != stamps[0]


def test_the_digest_follows_the_order_of_the_train_files(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text('{"messages": []}\n')
    second.write_text('{"messages": [], "id": 2}\n')
    recipe = tiny_recipe(tmp_path)
    cfg = load_recipe(recipe)
    paths = demo.demo_paths(cfg)
    one = cfg.model_copy(update={"data": cfg.data.model_copy(update={"train_files": [str(first), str(second)]})})
    two = cfg.model_copy(update={"data": cfg.data.model_copy(update={"train_files": [str(second), str(first)]})})
    assert demo_state.answers_digest(paths, one) != demo_state.answers_digest(paths, two)
    gone = cfg.model_copy(update={"data": cfg.data.model_copy(update={"train_files": [str(tmp_path / "no.jsonl")]})})
    assert demo_state.answers_digest(paths, gone) is None
