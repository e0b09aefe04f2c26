"""Session 53: an evaluation of an *export* goes on a model card by the weights it read, not by
file times. A report that measured ``RUN/export`` was taken by ``export RUN`` whenever it was
newer than the newest checkpoint, so an export of an older checkpoint, evaluated after a newer
one was saved, put that older draft's table on the newer draft's card."""

from __future__ import annotations

import json

import torch
from eval_helpers import random_prompts, tiny_eval_draft
from test_eval_cli import recipe_path  # noqa: F401  (fixture)
from test_export import _write_checkpoint

from draftforge.config import load_recipe
from draftforge.splitserve.target import build_target


def _run_with_two_checkpoints(recipe_path, tmp_path, *, target_layer_ids=None):  # noqa: F811
    """RUN/checkpoints/step_2 and step_4, their fc.weight different; the draft's target layers
    as given (the recipe's by default)."""
    recipe = load_recipe(recipe_path)
    target = build_target(recipe.target, recipe.draft.target_layer_ids)
    draft = tiny_eval_draft(target)
    if target_layer_ids is not None:
        draft.config.target_layer_ids = list(target_layer_ids)
    run, steps = tmp_path / "run", {}
    for step in (2, 4):
        folder = run / "checkpoints" / f"step_{step:08d}"
        _write_checkpoint(folder, draft)
        (folder / "COMPLETE").touch()
        (folder / "trainer_state.json").write_text("{}")
        steps[step] = folder
        with torch.no_grad():
            draft.fc.weight.add_(0.01)
    return run, steps


def _evaluate(recipe_path, tmp_path, draft) -> dict:  # noqa: F811
    from draftforge.eval.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"workload": "w", "input_ids": random_prompts(1)[0]}) + "\n")
    out = draft.parent / "eval"
    assert main([str(draft), "--recipe", str(recipe_path), "--prompts-file", str(prompts), "--max-new-tokens", "6",
                 "--baselines", "none", "--no-estimate", "--out", str(out)]) == 0  # fmt: skip
    return json.loads((out / "report.json").read_text())


def test_an_evaluated_export_of_an_older_checkpoint_stays_off_the_newer_ones_card(recipe_path, tmp_path, capsys):  # noqa: F811
    from draftforge.cli import main
    from draftforge.train.hf_load import export_fingerprint

    run, steps = _run_with_two_checkpoints(recipe_path, tmp_path)
    # the older checkpoint exported into the run's export folder and evaluated, after step 4
    # was saved: the report is newer than every checkpoint
    assert main(["export", str(steps[2]), "--out", str(run / "export")]) == 0
    report = _evaluate(recipe_path, tmp_path, run / "export")
    assert report["draft_fingerprint"] == export_fingerprint(run / "export")
    capsys.readouterr()

    assert main(["export", str(run), "--out", str(tmp_path / "newest")]) == 0  # step 4's
    out = capsys.readouterr().out
    assert "measured other weights than checkpoint step_00000004 holds" in out, out
    assert "Not measured" in (tmp_path / "newest" / "README.md").read_text()

    # the newest checkpoint's own export, evaluated: its table goes on the card
    assert main(["export", str(run), "--out", str(run / "export")]) == 0
    _evaluate(recipe_path, tmp_path, run / "export")
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "again")]) == 0
    assert f"model card: acceptance table from {run / 'eval' / 'report.md'}" in capsys.readouterr().out


def test_an_export_with_reordered_target_layers_is_matched_by_the_weights_it_wrote(recipe_path, tmp_path, capsys):  # noqa: F811
    """Unsorted target_layer_ids are exported ascending with fc.weight's column blocks permuted,
    so the export's fc.weight is not the checkpoint's: export compares what it writes."""
    from draftforge.cli import main

    ids = load_recipe(recipe_path).draft.target_layer_ids
    assert len(ids) > 1 and list(ids) == sorted(ids)
    run, steps = _run_with_two_checkpoints(recipe_path, tmp_path, target_layer_ids=list(reversed(ids)))
    assert main(["export", str(run), "--out", str(run / "export")]) == 0
    report = _evaluate(recipe_path, tmp_path, run / "export")
    from test_export_r52 import checkpoint_fingerprint

    assert report["draft_fingerprint"] != checkpoint_fingerprint(steps[4])  # permuted columns
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "again")]) == 0
    assert f"model card: acceptance table from {run / 'eval' / 'report.md'}" in capsys.readouterr().out
