"""Session 53 (a CLI review): values the recipe accepted that torch refused once the ranks ran,
with a traceback and exit status 1 (which --max-restarts would even restart)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli_r15 import _run


@pytest.mark.parametrize("value,said", [
    ("1e10", "split.peer_timeout_s: must be less than or equal to 1000000000"),  # torch's store refused it
    ("1e300", "split.peer_timeout_s: must be less than or equal to 1000000000"),  # timedelta overflowed
    ("0.01", "split.peer_timeout_s: must be greater than or equal to 5"),  # the rendezvous timed out
])
def test_a_peer_timeout_torch_cannot_take_is_refused_with_the_recipe(value, said, capsys):
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    code, _, err = _run(["config", "show", recipe, f"split.peer_timeout_s={value}"], capsys)
    assert code == 2 and said in err and "Traceback" not in err, err


@pytest.mark.parametrize("what", ["export", "eval report"])
def test_training_into_an_export_or_a_report_folder_is_refused(tmp_path, capsys, what):
    """It trained there (exit 0): eval then read the folder as the export, export as the run."""
    from eval_helpers import tiny_eval_draft, tiny_target

    from draftforge.train.export import export_draft

    folder = tmp_path / "out"
    if what == "export":
        export_draft(tiny_eval_draft(tiny_target()), folder, progress=lambda _: None)
        said = "is a draft export (config.json and its weights)"
    else:
        folder.mkdir()
        (folder / "report.json").write_text("{}")
        said = "holds an evaluation report (report.json"
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    code, _, err = _run(["train", recipe, f"train.output_dir={folder}", "--dry-run"], capsys)
    assert code == 2 and f"train.output_dir: {folder} {said}" in err, err
    assert not (folder / "config.yaml").exists() and not (folder / "checkpoints").exists()
