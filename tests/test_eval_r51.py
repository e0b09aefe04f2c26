"""Session 51: recipe eval settings that greedy decoding or full verification do not use are
said, and report.json records the settings decoding used."""

from __future__ import annotations

import json

from test_eval_cli import _tiny_export_and_prompts, recipe_path  # noqa: F401 - the fixture

from draftforge.eval.cli import main


def _eval(recipe, tmp_path, capsys, extra=()):
    export_dir, prompts = _tiny_export_and_prompts(recipe, tmp_path)
    out = tmp_path / "r"
    assert main([str(export_dir), "--recipe", str(recipe), "--prompts-file", str(prompts),
                 "--max-new-tokens", "6", "--baselines", "none", "--no-estimate", "--out", str(out),
                 *extra]) == 0  # fmt: skip
    return json.loads((out / "report.json").read_text())["settings"], capsys.readouterr().out


def test_sampling_settings_a_greedy_eval_ignores_are_said_and_not_recorded(recipe_path, tmp_path, capsys):  # noqa: F811
    """--top-k and the like are refused at temperature 0; the recipe's eval.top_k, top_p and
    draft_sampling were ignored without a word and written to report.json as if they applied."""
    recipe = tmp_path / "sampling.yaml"
    text = recipe_path.read_text()
    assert "\neval:\n" in text
    recipe.write_text(text.replace("\neval:\n", "\neval:\n  top_k: 20\n  top_p: 0.8\n  draft_sampling: sample\n"
                                   "  confidence_threshold: 0.9\n", 1))
    settings, out = _eval(recipe, tmp_path, capsys)
    assert (settings["top_k"], settings["top_p"], settings["draft_sampling"]) == (0, 1.0, "greedy")
    assert ("eval: not applied from the recipe: eval.top_k 20, eval.top_p 0.8, eval.draft_sampling 'sample' "
            "(decoding is greedy: temperature 0); eval.confidence_threshold 0.9 ('full' verification "
            "verifies every drafted slot)") in out
    # sampling uses them, and says nothing
    settings, out = _eval(recipe, tmp_path, capsys, ["--temperature", "0.7", "--verify", "threshold"])
    assert (settings["top_k"], settings["top_p"], settings["draft_sampling"]) == (20, 0.8, "sample")
    assert "not applied from the recipe" not in out


def test_a_recipe_without_such_settings_gets_no_note(recipe_path, tmp_path, capsys):  # noqa: F811
    settings, out = _eval(recipe_path, tmp_path, capsys)
    assert "not applied from the recipe" not in out and settings["draft_sampling"] == "greedy"
