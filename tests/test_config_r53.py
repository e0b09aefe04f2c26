"""Session 53 (a CLI review): values the recipe accepted that torch refused once the ranks ran,
with a traceback and exit status 1 (which --max-restarts would even restart)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli_r15 import _run


@pytest.mark.parametrize("value,said", [
    ("1e10", "split.peer_timeout_s: must be less than or equal to 1000000000"),  # torch's store refused it
    ("1e300", "split.peer_timeout_s: must be less than or equal to 1000000000"),  # timedelta overflowed
    ("0.01", "split.peer_timeout_s: must be greater than or equal to 1"),  # the rendezvous timed out
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


def test_a_finished_run_rerun_starts_no_rank_and_leaves_its_files(tmp_path):
    """A finished run rerun (here with another learning rate) loaded the target, rotated its
    config.yaml to config.1.yaml for the new one (which no step used), added a segment to
    run.json, and printed an accounting of zeros."""
    import subprocess
    import sys

    from splitserve_helpers import tiny_recipe

    recipe = tiny_recipe(tmp_path, steps=4)
    first = subprocess.run([sys.executable, "-m", "draftforge", "train", str(recipe)],
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "run"
    before = {name: (run / name).read_bytes() for name in ("config.yaml", "run.json", "summary.json")}
    again = subprocess.run([sys.executable, "-m", "draftforge", "train", str(recipe), "train.lr=1e-4"],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (f"draftforge train: nothing to train: checkpoint {run / 'checkpoints' / 'step_00000004'} is at "
            f"step 4 and train.steps is 4; the run in {run} is left as it is") in again.stdout, again.stdout
    assert "[rank" not in again.stdout + again.stderr  # no rank started
    assert {name: (run / name).read_bytes() for name in before} == before
    assert not (run / "config.1.yaml").exists()
    dry = subprocess.run([sys.executable, "-m", "draftforge", "train", str(recipe), "--dry-run"],
                         capture_output=True, text=True, timeout=600)
    assert dry.returncode == 0 and "note: draftforge train: nothing to train" in dry.stdout, dry.stdout[-2000:]
    # a missing summary.json is rebuilt by a rerun (README), so that one starts the ranks
    (run / "summary.json").unlink()
    rebuilt = subprocess.run([sys.executable, "-m", "draftforge", "train", str(recipe)],
                             capture_output=True, text=True, timeout=600)
    assert rebuilt.returncode == 0 and "nothing to train" not in rebuilt.stdout, rebuilt.stdout[-2000:]
    assert (run / "summary.json").is_file()
    # a checkpoint of another run named by train.resume is saved into the new run by a rerun
    other = subprocess.run([sys.executable, "-m", "draftforge", "train", str(recipe),
                            f"train.output_dir={tmp_path / 'run2'}",
                            f"train.resume={run / 'checkpoints' / 'step_00000004'}"],
                           capture_output=True, text=True, timeout=600)
    assert other.returncode == 0 and "nothing to train" not in other.stdout, other.stderr[-2000:]
    assert (tmp_path / "run2" / "checkpoints" / "step_00000004").is_dir()


def test_a_run_folder_that_also_holds_an_evaluation_report_still_trains(tmp_path):
    """'eval RUN/export --out RUN' is allowed; the run must still continue afterwards."""
    from splitserve_helpers import tiny_recipe

    from draftforge.config import load_recipe
    from draftforge.splitserve.launch import Preflight, preflight

    cfg = load_recipe(tiny_recipe(tmp_path, steps=4))
    run = Path(cfg.train.output_dir)
    run.mkdir()
    (run / "report.json").write_text("{}")
    (run / "config.yaml").write_text(cfg.to_yaml())
    # no refusal (a run is there): the data is read from its file, no checkpoint to resume yet
    assert preflight(cfg) == Preflight(regenerate=False, resume_from=None, resume_step=None)
    assert (run / "report.json").read_text() == "{}"  # the report is left as it was

