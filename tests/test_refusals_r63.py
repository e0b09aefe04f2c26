"""Session 63: refusals come before the target loads, and leave no empty folder.

A review found a second run on a file being written, and a folder where the lock cannot be
made, refused only once every worker had loaded the target (seconds for SmolLM2, minutes for
a large one); ``target.backend: sglang`` without SGLang a traceback (a RuntimeError, which
``draftforge train`` restarted as a failure); and refusals leaving the folders they made.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from draftforge import cli
from draftforge.files import made_folder
from draftforge.splitserve import target as target_module

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-debug.yaml")
SMOLLM2 = str(ROOT / "recipes" / "smollm2-cpu.yaml")

_HOLD = """
import sys, time
from pathlib import Path
from draftforge.files import exclusive_lock
with exclusive_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def no_target_load(monkeypatch):
    """build_target counted, never run: a refusal must come before it."""
    loads = []

    def build_target(*args, **kwargs):
        loads.append(args)
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(target_module, "build_target", build_target)
    return loads


def test_a_file_another_run_writes_is_refused_before_the_target_loads(tmp_path, capsys, no_target_load):
    out = tmp_path / "answers.jsonl"
    child = subprocess.Popen([sys.executable, "-c", _HOLD, str(out) + ".lock"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "held\n"
        code = cli.main(["data", "regenerate", TINY, f"data.regenerated_file={out}", "data.num_samples=4",
                         "--workers", "1", "--no-progress"])
    finally:
        child.kill()
        child.wait()
    err = capsys.readouterr().err
    assert code == 2 and no_target_load == []
    assert f"{out}: another draftforge data regenerate (process {child.pid}) is writing it" in err


def test_a_folder_that_refuses_the_lock_names_the_key_before_the_target_loads(tmp_path, capsys, no_target_load):
    folder = tmp_path / "answers-folder"
    folder.mkdir()
    (folder / "answers.jsonl.lock").mkdir()  # the lock cannot be made there: a folder holds its name
    out = folder / "answers.jsonl"
    code = cli.main(["data", "regenerate", TINY, f"data.regenerated_file={out}", "data.num_samples=4",
                     "--workers", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and no_target_load == []
    assert f"data.regenerated_file {out}: cannot make its lock file answers.jsonl.lock there" in err


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_sglang_missing_is_an_input_error_before_any_folder(tmp_path, capsys, no_target_load):
    run = tmp_path / "run"
    code = cli.main(["data", "regenerate", SMOLLM2, "target.backend=sglang", f"train.output_dir={run}",
                     "data.num_samples=2", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and no_target_load == []
    assert "draftforge data regenerate: error: target.backend 'sglang' needs the sglang package" in err
    assert "Traceback" not in err and not run.exists()


def test_made_folders_go_again_when_nothing_was_written(tmp_path):
    deep = tmp_path / "a" / "b" / "c"
    with made_folder(deep):
        assert deep.is_dir()
    assert not (tmp_path / "a").exists()  # all three were made here, and left empty
    (tmp_path / "a").mkdir()
    with made_folder(deep):
        (deep.parent / "kept.txt").write_text("x")
    assert not deep.exists() and (tmp_path / "a" / "b" / "kept.txt").exists()  # b holds a file: kept
    with pytest.raises(RuntimeError), made_folder(tmp_path / "x" / "y"):
        raise RuntimeError("refused")
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_train_refuses_a_missing_sglang_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    """Every target rank raised it after the start, and split.restart_target restarted the job
    three times to meet it again."""
    from draftforge.splitserve import launch

    started = []
    monkeypatch.setattr(launch, "_supervise", lambda *args, **kwargs: started.append(args) or 0)
    code = cli.main(["train", SMOLLM2, "target.backend=sglang", f"train.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert (code, started) == (2, [])
    assert "draftforge train: error: target.backend 'sglang' needs the sglang package" in err


def test_a_refused_demo_leaves_no_folder(tmp_path, capsys, monkeypatch):
    """The demo's lock made train.output_dir's parent (runs/) before the options were checked."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", TINY, "--max-new-tokens", "1"]) == 2
    assert "--max-new-tokens 1: the first new token comes from the prompt's prefill" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def _run_with_checkpoint(run: Path, *, run_json: bool = True) -> Path:
    from draftforge.train.checkpoint import COMPLETE, STATE_FILE, checkpoint_path

    step = checkpoint_path(run, 6)
    step.mkdir(parents=True)
    (step / COMPLETE).write_text("")
    (step / STATE_FILE).write_text("{}")
    (run / "config.yaml").write_text("train: {}\n")  # every run folder records its resolved config
    if run_json:
        (run / "run.json").write_text('{"segments": []}')
    return step


def test_outputs_inside_a_runs_checkpoints_are_refused(tmp_path):
    """A review wrote an eval report into step_00000006 and exports into step folders; the
    next training segment pruned them away without a word."""
    from draftforge.errors import InputError
    from draftforge.eval.cli import _check_output_paths
    from draftforge.train.checkpoint import checkpoints_holding
    from draftforge.train.export_cli import _check_out_apart

    run = tmp_path / "r1"
    step = _run_with_checkpoint(run)
    checkpoints = run / "checkpoints"
    for inside in (checkpoints, step, step / "eval", step / "a" / "b"):
        assert checkpoints_holding(inside) == checkpoints
    for outside in (run, run / "eval", run / "export", tmp_path):
        assert checkpoints_holding(outside) is None
    old = tmp_path / "old"  # a run folder without run.json: its complete checkpoints tell it
    assert checkpoints_holding(_run_with_checkpoint(old, run_json=False) / "x") == old / "checkpoints"
    # folders merely named so are not a run's (the review of this change found both taken for one):
    # another tool's run.json beside a checkpoints/ folder, and an archive of checkpoints
    other = tmp_path / "proj"
    (other / "checkpoints" / "eval").mkdir(parents=True)
    (other / "run.json").write_text('{"tool": "mlflow-like"}')
    assert checkpoints_holding(other / "checkpoints" / "eval") is None
    archive = tmp_path / "archive"
    _run_with_checkpoint(archive, run_json=False)
    (archive / "config.yaml").unlink()
    assert checkpoints_holding(archive / "checkpoints" / "step_00000006" / "eval") is None

    with pytest.raises(InputError, match=rf"^--out {step}: lies inside the training run's checkpoints "
                       rf"\({checkpoints}\), .*e\.g\. {run / 'eval'}$"):
        _check_output_paths(str(step), None)
    with pytest.raises(InputError, match=rf"^--calibrate {step / 'cal.json'}: lies inside"):
        _check_output_paths(str(tmp_path / "report"), str(step / "cal.json"))
    other = tmp_path / "other" / "checkpoints" / "step_00000002"  # exporting another run's checkpoint
    with pytest.raises(InputError, match=rf"^--out {step / 'exp'} lies inside a training run's checkpoints "
                       rf"\({checkpoints}\), .*e\.g\. {run / 'export'}\)$"):
        _check_out_apart(step / "exp", other, None)
    _check_output_paths(str(run / "eval"), str(run / "eval" / "cal.json"))  # the run's own places
    _check_out_apart(run / "export", step, run)


@pytest.mark.parametrize("addr", ["0.0.0.0", "127.0.0.1", "localhost"])
def test_a_multinode_dry_run_refuses_a_master_addr_a_start_refuses(addr, capsys):
    """The dry run printed the NODE0_ADDR placeholder in its place, exit 0."""
    recipe = str(ROOT / "recipes" / "ling3-flash-2node.yaml")
    assert cli.main(["train", recipe, "--dry-run", "--node-rank", "0", "--master-addr", addr]) == 2
    err = capsys.readouterr().err
    assert err.startswith("draftforge train: error: --master-addr: ") and f"{addr} " in err
    assert "cluster network" in err and err.count("\n") == 1


def test_a_multinode_dry_run_keeps_its_placeholder_without_an_address_and_shows_one_given(capsys):
    recipe = str(ROOT / "recipes" / "ling3-flash-2node.yaml")
    assert cli.main(["train", recipe, "--dry-run"]) == 0
    assert "torchrun static rendezvous at NODE0_ADDR:29500 (node 0)" in capsys.readouterr().out
    assert cli.main(["train", recipe, "--dry-run", "--master-addr", "10.0.0.5"]) == 0
    assert "torchrun static rendezvous at 10.0.0.5:29500 (node 0)" in capsys.readouterr().out


def test_a_dry_run_of_a_piped_recipe_says_a_start_refuses_it(tmp_path):
    pipe = subprocess.run(["bash", "-c", f"{sys.executable} -m draftforge train <(cat {TINY}) --dry-run"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert pipe.returncode == 0, pipe.stderr
    assert pipe.stdout.rstrip().splitlines()[-1].endswith(
        "is not a regular file: a start refuses it, since every rank of the job reads the recipe again; "
        "save it to a file and start with that")
    plain = subprocess.run([sys.executable, "-m", "draftforge", "train", TINY, "--dry-run"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert plain.returncode == 0 and "not a regular file" not in plain.stdout
