"""What the demo finds already done: finished trainings, runs of this recipe and answers,
an export, evaluations and a model card still current; and what ``--force`` deletes."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import shutil
from collections.abc import Sequence
from pathlib import Path

from draftforge.eval.demo_runs import DemoPaths
from draftforge.eval.demo_stages import DemoError
from draftforge.files import write_atomic
from draftforge.train import metrics

ANSWERS_STAMP = "demo-answers.json"  # in each run folder: the digest of the answers it trained on


def mtime(path: Path) -> float:
    return path.stat().st_mtime if path.exists() else -math.inf


def final_checkpoint(run_dir: Path, steps: int) -> Path | None:
    """The checkpoint that ends a finished run: ``step_<steps>``, or the last one of a run
    that stopped early because its data ran out; None while the run is unfinished."""
    from draftforge.train import checkpoint as ckpt

    done = ckpt.checkpoint_path(run_dir, steps)
    if ckpt.is_complete(done):
        return done
    return data_ran_out(run_dir)


def data_ran_out(run_dir: Path) -> Path | None:
    """The last checkpoint of a run that stopped before its steps because its data ran out
    (its summary.json says so); None for any other run."""
    from draftforge.train import checkpoint as ckpt

    summary = run_dir / "summary.json"
    if summary.is_file():
        info = json.loads(summary.read_text())
        path = Path(str(info.get("checkpoint") or ""))
        if info.get("stopped_reason") == "data_exhausted" and path.name and ckpt.is_complete(path):
            return path
    return None


def _resolved_again(saved: Path) -> str:
    """A run's saved recipe resolved by this version, so that an option added since (with
    its default) does not count as a difference; the text as it is if it no longer loads."""
    from draftforge.config import load_recipe

    try:
        return load_recipe(saved).to_yaml()
    except ValueError:
        return saved.read_text()


def _training_part(recipe_yaml: str) -> str:
    """The recipe without what does not change what the steps train (its eval and export
    sections, log and checkpoint intervals, the run's name...: ``NOT_TRAINED``, the list the
    trainer's resume uses; and ``data.regenerated_file``, the answers' path), so that editing
    those, or moving the demo's runs, does not call a finished run another recipe's."""
    import yaml

    from draftforge.recipe_errors import RecipeError
    from draftforge.recipe_yaml import read_yaml
    from draftforge.train.recipe_changes import without_untrained

    try:
        data = read_yaml(recipe_yaml, "a run's recipe")
    except RecipeError:
        return recipe_yaml
    if not isinstance(data, dict):
        return recipe_yaml
    data = without_untrained(data)
    # where the answers file lies is no trained setting either: the DFlash run names the DSpark
    # run's as a path (its override), which moving the runs changes; what the file holds is
    # compared by the answers stamp (check_trained_on)
    if isinstance(data.get("data"), dict):
        data["data"] = {key: value for key, value in data["data"].items() if key != "regenerated_file"}
    return yaml.safe_dump(data, sort_keys=False)


SKIP_TRAIN_FIX = ("--skip-train uses the runs as they are: undo the edit, or drop --skip-train and pass --retrain "
                  "(or --force to start over)")


def check_same_recipe(run_dir: Path, expected_yaml: str, what: str, *, skip_train: bool = False,
                      other_option: tuple[str, str] | None = None, force_does: str = "") -> None:
    """Refuse to resume or reuse a run directory that holds a run of another recipe (its
    eval and export sections aside). ``skip_train``: the demo would not train, so --force
    (which then keeps the runs) is no fix. ``other_option``: a demo option and the recipe it
    would train (``--markov-init``), named as the fix when the run is that recipe's.
    ``force_does``: what --force deletes and redoes (:func:`force_deletes`), said with it."""
    texts = other_recipe(run_dir, expected_yaml)
    if texts is None:
        return
    old_text, new_text = texts
    saved = run_dir / "config.yaml"
    retrain = "--retrain to train it again on the same answers, or " if not skip_train else ""
    if other_option is not None and old_text == _training_part(other_option[1]):
        raise DemoError(
            f"{run_dir} holds the {what} run of this recipe trained with {other_option[0]}: pass "
            f"{other_option[0]} to use it"
            + ("" if skip_train else f", or {retrain}--force to train again from scratch"
               f"{force_does or ' (it deletes that run)'}"),
            exit_status=2,
        )
    old = old_text.splitlines()
    new = new_text.splitlines()
    first = next(
        (i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b),
        min(len(old), len(new)),
    )
    line = lambda lines: lines[first].strip() if first < len(lines) else "(end of file)"  # noqa: E731
    raise DemoError(
        f"{run_dir} holds a {what} run of a different recipe ({saved} resolved, line {first + 1}: "
        f"{line(old)!r}; this demo: {line(new)!r}). "
        + (f"{SKIP_TRAIN_FIX}." if skip_train else f"Rerun with {retrain}--force to train again from "
           f"scratch{force_does or ' (it deletes that run)'}, or move the folder away."),
        exit_status=2,
    )


def other_recipe(run_dir: Path, expected_yaml: str) -> tuple[str, str] | None:
    """``(saved, expected)``, the training parts of the recipe a run in ``run_dir`` was trained
    with (resolved by this version) and of ``expected_yaml``, where the run has complete
    checkpoints and they differ; None otherwise (no run there, or this recipe's)."""
    from draftforge.train import checkpoint as ckpt

    saved = run_dir / "config.yaml"
    if not ckpt.complete_checkpoints(run_dir) or not saved.is_file():
        return None
    old_text, new_text = _training_part(_resolved_again(saved)), _training_part(expected_yaml)
    return None if old_text == new_text else (old_text, new_text)


def force_deletes(paths: DemoPaths) -> str:
    """What ``--force`` (without --skip-train) deletes and does again, in parentheses, as said
    after "--force to train again from scratch": every output of the demo, not only the run
    whose recipe differs."""
    answers = f", the regenerated answers {paths.data_file}" if paths.data_file is not None else ""
    again = "regenerates the answers and trains" if paths.data_file is not None else "trains"
    return (f" (it deletes both runs, DSpark's {paths.run_dir} and DFlash's {paths.dflash_dir}{answers}, "
            f"the export {paths.export_dir} and the evaluations, then {again} both drafts again)")


def _same_command(recorded: str | list | None, args: Sequence[str]) -> bool:
    """Whether a recorded command is ``args``, however the recipe's path was spelt."""
    if isinstance(recorded, str):
        recorded = shlex.split(recorded)[1:] if recorded.startswith("draftforge ") else None
    if not isinstance(recorded, list):
        return False

    def normal(argv: Sequence[str]) -> list[str]:
        return [os.path.realpath(a) if i and argv[i - 1] == "--recipe" else a for i, a in enumerate(argv)]

    return normal(recorded) == normal(list(args))


def eval_is_current(eval_dir: Path, args: Sequence[str], newer_than: Path, settings: dict | None = None,
                    fingerprints: set[str] | None = None) -> bool:
    """An evaluation report written by exactly this command after its draft was made, with
    ``settings`` (what the command takes from the recipe's eval section) as its own, and where
    ``fingerprints`` (the chosen checkpoint's, :func:`checkpoint_fingerprints`) are known, of
    those weights: not of a checkpoint a training wrote later."""
    report = eval_dir / "report.json"
    if not report.is_file() or mtime(report) < mtime(newer_than):
        return False
    try:
        written = json.loads(report.read_text())
    except json.JSONDecodeError:
        return False
    if not _same_command(written.get("command"), ["eval", *args]):
        return False
    if measured_other_weights(written, fingerprints) is not None:
        return False
    recorded = written.get("settings") or {}
    return all(recorded.get(key) == value for key, value in (settings or {}).items())


EXPORT_STAMP = "demo-export.json"  # in the DSpark run folder: the export stage's command and files
EXPORT_RECIPE = "demo-export-recipe.yaml"  # beside it: the recipe the export stage names


def checkpoint_step(checkpoint: Path) -> int:
    """The step of a ``step_00000360`` checkpoint folder."""
    return int(checkpoint.name.removeprefix("step_"))


def _digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def stamp_answers(run_dir: Path, answers: str, what: str, *, regenerated: bool = True) -> None:
    """Record the answers a training is about to train on; a run that already has
    checkpoints must have trained on these (a resume), one without any may start afresh."""
    from draftforge.train.checkpoint import complete_checkpoints

    if complete_checkpoints(run_dir):
        check_trained_on(run_dir, answers, what, regenerated=regenerated)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / ANSWERS_STAMP, json.dumps({"sha256": answers}))


def trained_on_other_answers(run_dir: Path, answers: str | None) -> bool:
    """Whether a run with complete checkpoints records other answers than ``answers`` (a run
    that records none is not judged: :func:`check_trained_on` says so)."""
    from draftforge.train.checkpoint import complete_checkpoints

    recorded = recorded_answers(run_dir)
    return answers is not None and recorded is not None and recorded != answers and bool(
        complete_checkpoints(run_dir))


#: what a training writes in its run folder, and the demo's record of the answers it trained on:
#: what ``--retrain`` deletes, the checkpoints first
TRAINING_ENTRIES = ("checkpoints", ANSWERS_STAMP, metrics.SUMMARY_FILE, metrics.PLOT_FILE, metrics.METRICS_FILE,
                    "accounting.jsonl", "tensorboard", "wandb", metrics.WANDB_ID_FILE, metrics.RUN_FILE,
                    metrics.CONFIG_FILE)


def remove_training(run_dir: Path) -> None:
    """``--retrain``: delete the training ``run_dir`` holds (:data:`TRAINING_ENTRIES` and the
    recipes it set aside, ``config.N.yaml``), under its training lock, so that the stage trains
    it again from scratch; what else lies there (the answers, the export, the evaluations, the
    stages' logs) is kept, and the stages after the training redo what depends on it. The
    checkpoints go first: a stop midway leaves a folder a training starts afresh in."""
    import re

    from draftforge.train.checkpoint import CheckpointError, claim_run_dir, release_run_dir

    try:
        claim_run_dir(run_dir)
    except CheckpointError as err:
        raise DemoError(f"--retrain would delete a run that is training: {err}", exit_status=2) from None
    try:
        rotated = sorted(entry.name for entry in run_dir.iterdir() if re.fullmatch(r"config\.\d+\.yaml", entry.name))
        for name in (*TRAINING_ENTRIES, *rotated):
            remove_output(run_dir / name, (), verb="--retrain")
    finally:
        release_run_dir(run_dir)


def recorded_answers(run_dir: Path) -> str | None:
    """The digest of the answers a run records it trained on (:func:`stamp_answers`), or None."""
    try:
        digest = json.loads((run_dir / ANSWERS_STAMP).read_text()).get("sha256")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return digest if isinstance(digest, str) else None


def check_trained_on(run_dir: Path, answers: str | None, what: str, *, skip_train: bool = False,
                     regenerated: bool = True) -> None:
    """Refuse a run trained (or being trained) on other answers than the training data holds
    now: the regenerated file written again since (another machine's threads give other
    answers in bf16), or with ``regenerated=False`` data.train_files edited since. A run that
    records none (trained before the record, or outside the demo) is not checked, and said."""
    try:
        recorded = json.loads((run_dir / ANSWERS_STAMP).read_text()).get("sha256")
    except (OSError, json.JSONDecodeError, AttributeError):
        if answers is not None:
            fix = ("drop --skip-train and pass --force to train it again on these answers" if skip_train
                   else "--force trains it again on these answers")
            print(f"demo: note: {run_dir} records no answers it trained on (trained outside the demo, "
                  f"or before it recorded them): the {what} draft is used unchecked; {fix}", flush=True)
        return
    if answers is not None and recorded != answers:
        raise DemoError(
            f"{run_dir}: the {what} draft was trained on "
            + ("other answers than the regenerated file holds now (it was written again since); "
               if regenerated else
               "other conversations than data.train_files hold now (a file was edited or the list "
               "changed since); ")
            + ("--skip-train uses the runs as they are: drop --skip-train and pass --retrain to "
               "train it on these answers (or --force to start over)" if skip_train else
               "rerun the demo with --retrain to train it on these answers (or --force to start over)"),
            exit_status=2,
        )


def export_files(export_dir: Path) -> str:
    """The digest of an export folder's files but its model card (the last stage writes it again):
    its config and weights, the same for every export of one checkpoint by one command
    (``train.export.export_digest``). Read under the lock ``draftforge export`` holds while it
    writes the folder, so that no export replaces it midway; one writing it now is refused."""
    with export_held(export_dir):
        from draftforge.train.export import export_digest

        return export_digest(export_dir)


@contextlib.contextmanager
def export_held(export_dir: Path, expected: str | None = None):
    """Hold the lock ``draftforge export`` holds while it writes ``export_dir`` while the block
    runs (an evaluation reading the folder: no export replaces it meanwhile); one writing it now is
    refused. ``expected``: the digest the folder must hold (:func:`export_files`, as the demo's
    export stage reported it): another export that replaced it since is refused too."""
    from draftforge.train.export import ExportError, export_digest, export_lock

    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(export_lock(export_dir.expanduser().resolve(),
                                            then="wait for it to finish, then rerun the demo"))
        except ExportError as err:
            raise DemoError(str(err), exit_status=2) from None
        if expected is not None and export_digest(export_dir) != expected:
            raise DemoError(
                f"{export_dir} no longer holds the export the demo's export stage wrote: another "
                "'draftforge export' into it replaced it since; rerun the demo (it exports the draft "
                "again), and export elsewhere (--out) meanwhile", exit_status=2)
        yield


def reported_export_files(lines: Sequence[str] | None) -> str:
    """The digest the export stage printed on its ``export_files=`` line (the folder it wrote,
    digested under its own lock: ``train.export.export_digest``); a stage that printed none is
    a failure."""
    from draftforge.train.export_cli import EXPORT_FILES_KEY

    reported = [line.split("=", 1)[1].strip() for line in lines or ()
                if line.startswith(f"{EXPORT_FILES_KEY}=")]
    if not reported:
        raise DemoError(f"the export stage printed no {EXPORT_FILES_KEY}= line (the digest of the folder "
                        "it wrote), so the demo cannot tell its export from another one written into "
                        "the same folder since; is 'python -m draftforge' this demo's draftforge?")
    return reported[-1]


def stamped_files(stamp: Path) -> str | None:
    """The export digest the demo's stamp records (None: no stamp, or one written before the
    digest was recorded)."""
    try:
        files = json.loads(stamp.read_text()).get("files")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return files if isinstance(files, str) else None


def export_is_current(paths, export_args: Sequence[str], checkpoint: Path) -> bool:
    """The export folder was written by exactly this command after the draft's last checkpoint,
    and holds what it wrote: not another export since (``draftforge export`` of an earlier
    checkpoint writes to the same folder by default)."""
    stamp = paths.run_dir / EXPORT_STAMP
    if mtime(paths.export_dir / "config.json") < mtime(checkpoint / "COMPLETE"):
        return False
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if not _same_command(recorded.get("command"), export_args):
        return False
    files = recorded.get("files")  # stamps written before the digest: not checked
    return files is None or files == export_files(paths.export_dir)


def check_removable(outputs: Sequence[Path], keep: Sequence[Path], export_dir: Path) -> None:
    """Refuse ``--force`` before it deletes anything: an output holding what must stay, or an
    ``export_dir`` (the recipe's ``export.out_dir``, outside the folders deleted with it) that
    is not an earlier export, which ``draftforge export`` itself would refuse to replace."""
    for path in outputs:
        _check_keeps(path, keep)
    if export_dir not in outputs or any(
        other != export_dir and export_dir.resolve().is_relative_to(other.resolve()) for other in outputs
    ):
        return
    check_export_destination(export_dir, "--force would delete")


def check_export_destination(export_dir: Path, what: str) -> None:
    """Refuse an ``export.out_dir`` that ``draftforge export`` would refuse to replace (a
    folder that is not an earlier export), in the words of the demo, which has no --out;
    ``what`` says why it is asked (``--force would delete``, or the export stage to come)."""
    from draftforge.train.export import ExportError, check_destination

    try:
        check_destination(export_dir)
    except ExportError as err:
        raise DemoError(f"{what} {export_dir} (export.out_dir): "
                        f"{str(err).replace('choose another --out', 'set another export.out_dir')}",
                        exit_status=2) from None


def _saved_run(folder: Path) -> dict | None:
    """The ``config.yaml`` a training wrote in ``folder``, if it names ``folder`` as its
    ``train.output_dir`` (by name: it was resolved elsewhere); None otherwise."""
    from draftforge.recipe_errors import RecipeError
    from draftforge.recipe_yaml import read_yaml

    path = folder / "config.yaml"
    try:
        saved = read_yaml(path.read_text(encoding="utf-8"), str(path))
        ours = Path(saved["train"]["output_dir"]).name == folder.name
        return saved if ours and isinstance(saved["draft"], dict) else None
    except (OSError, UnicodeDecodeError, RecipeError, KeyError, TypeError):
        return None


def check_dflash_removable(dflash_dir: Path) -> None:
    """Refuse ``--force`` where the folder the demo derives for its DFlash run (the recipe's
    ``train.output_dir`` with ``-dflash`` added; no recipe names it) holds something else than
    a DFlash run written there: a run folder of the user's own that happens to have that name."""
    if _before_training_only(dflash_dir):
        return
    draft = (_saved_run(dflash_dir) or {}).get("draft", {})
    if not (draft.get("markov_rank") == 0 and draft.get("enable_confidence_head") is False):
        raise DemoError(
            f"--force would delete {dflash_dir}, where the demo puts its DFlash ablation's run, but it "
            "does not hold a DFlash run written there (its config.yaml names another run or none); "
            "refusing. Move it away, or set another train.output_dir", exit_status=2)
    _refuse_foreign(dflash_dir, None, "the DFlash ablation's run folder")


def _before_training_only(folder: Path, data_file: Path | None = None) -> bool:
    """Whether ``folder`` is missing, or holds only what a demo leaves in a run folder before
    its training writes config.yaml there: the answers stamp, the stages' logs, the lock file of
    a training killed while starting, and the answers ``data_file`` (with its ``.partial`` and
    ``.lock``) where it lies in the folder."""
    from draftforge.train.checkpoint import RUN_LOCK

    if not folder.exists():
        return True
    before = {ANSWERS_STAMP, "demo-logs", RUN_LOCK}
    if data_file is not None and data_file.parent.absolute() == folder.absolute():
        before |= {data_file.name + suffix for suffix in ("", ".partial", ".lock")}
    return folder.is_dir() and all(entry.name in before for entry in folder.iterdir())


def check_run_removable(run_dir: Path, data_file: Path | None, also: Sequence[Path] = ()) -> None:
    """Refuse ``--force`` where ``train.output_dir`` holds something else than a run written
    there or what the demo writes before its training: a folder of the user's own, or a run
    folder holding files of the user's own beside the run (:func:`foreign_entries`; ``also``:
    the demo's other outputs, which the recipe may put there under names of its own)."""
    if _before_training_only(run_dir, data_file):
        return
    if run_dir.is_dir() and _saved_run(run_dir) is not None:
        _refuse_foreign(run_dir, data_file, "train.output_dir", also)
        return
    raise DemoError(
        f"--force would delete {run_dir} (train.output_dir), but it holds neither a run written there "
        "(its config.yaml names another run or none) nor what the demo writes before training; "
        "refusing. Move it away, or set another train.output_dir", exit_status=2)


#: what a training, ``data regenerate`` (its default answers file), ``export`` and ``eval`` (their
#: default folders) and the demo write in a run folder
RUN_ENTRIES = frozenset({
    *(metrics.CONFIG_FILE, metrics.RUN_FILE, metrics.METRICS_FILE, metrics.SUMMARY_FILE, metrics.PLOT_FILE,
      metrics.WANDB_ID_FILE),
    "accounting.jsonl", "wandb", "tensorboard", "checkpoints", "regenerated.jsonl", "regenerated.jsonl.partial",
    "regenerated.jsonl.lock", "export", "eval", "eval-dflash", "demo.md", "demo-logs", ANSWERS_STAMP,
    EXPORT_STAMP, EXPORT_RECIPE,
    "calibration.json",  # where 'draftforge eval RUN/export --calibrate' suggests writing it
})


def foreign_entries(folder: Path, data_file: Path | None = None, also: Sequence[Path] = ()) -> list[str]:
    """The entries of a run folder that no draftforge command writes there (:data:`RUN_ENTRIES`,
    the rotated ``config.N.yaml``, the answers ``data_file`` and the ``also`` paths where they lie
    there, and the hidden locks, temporaries, staging folders and shared-folder markers of its
    writers), sorted."""
    import re

    known = set(RUN_ENTRIES)
    if data_file is not None and data_file.parent.absolute() == folder.absolute():
        known |= {data_file.name + suffix for suffix in ("", ".partial", ".lock")}
    known |= {path.name for path in also if path.parent.absolute() == folder.absolute()}
    writers = re.compile(r"^\.(shared-check-.*|.*(\.lock|\.tmp|\.removing|\.tmp-.*|\.old-.*))$")
    return sorted(entry.name for entry in folder.iterdir()
                  if entry.name not in known and not re.fullmatch(r"config\.\d+\.yaml", entry.name)
                  and not writers.match(entry.name))


def _refuse_foreign(folder: Path, data_file: Path | None, key: str, also: Sequence[Path] = ()) -> None:
    foreign = foreign_entries(folder, data_file, also)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise DemoError(
            f"--force would delete {folder} ({key}), a run folder that also holds what no draftforge "
            f"command writes there: {shown}; refusing. Move them away, or set another train.output_dir",
            exit_status=2)


def demo_held(run_dir: Path):
    """Hold the demo's lock on its runs (``.NAME.demo.lock`` beside ``run_dir``, which --force
    deletes) while the block runs; a second ``draftforge demo`` on the same runs is refused at
    once, naming the one running (two would run the same stages into the same folders)."""
    from draftforge.files import lock_or_refuse

    lock = run_dir.absolute().parent / f".{run_dir.name}.demo.lock"
    return lock_or_refuse(lock, lambda holder: DemoError(
        f"another draftforge demo is running on {run_dir} ({holder} holds {lock}); wait for it to "
        "end, or stop it", exit_status=2))


@contextlib.contextmanager
def writers_held(outputs: Sequence[Path], paths: DemoPaths):
    """Hold the locks of the writers whose outputs ``--force`` is about to delete: a training's
    ``RUN/.train.lock`` (in the folder deleted, so its holder would go on writing into a new
    one) and ``data regenerate``'s ``<answers>.lock``; refuse when a process holds one."""
    from draftforge.files import lock_or_refuse
    from draftforge.train.checkpoint import CheckpointError, claim_run_dir, release_run_dir

    claimed = []
    with contextlib.ExitStack() as stack:
        try:
            for folder in (paths.run_dir, paths.dflash_dir):
                if folder in outputs and folder.is_dir():
                    claim_run_dir(folder)
                    claimed.append(folder)
            answers = paths.data_file
            if answers is not None and answers in outputs and answers.parent.is_dir():
                stack.enter_context(lock_or_refuse(answers.with_name(answers.name + ".lock"), lambda holder: DemoError(
                    f"--force would delete {answers}, which 'draftforge data regenerate' ({holder}) is "
                    "writing; wait for it or stop it", exit_status=2)))
            yield
        except CheckpointError as err:
            raise DemoError(f"--force would delete a run that is training: {err}", exit_status=2) from None
        finally:
            for folder in claimed:  # its lock file went with the folder; the trainings take it anew
                release_run_dir(folder)


def _check_keeps(path: Path, keep: Sequence[Path]) -> None:
    if not path.exists():
        return
    resolved = path.resolve()
    for other in keep:
        other = other.resolve()
        if resolved == other or resolved in other.parents:
            raise DemoError(f"--force would delete {path}, which holds {other}; refusing", exit_status=2)


def remove_output(path: Path, keep: Sequence[Path], *, verb: str = "--force") -> None:
    """Delete a demo output (file or folder), refusing folders that hold what must stay;
    ``verb``: the option deleting it, as said."""
    if not path.exists():
        return
    _check_keeps(path, keep)
    print(f"    {verb}: removing {path}")
    if path.is_dir() and not path.is_symlink():
        # renamed aside first: a stop in the middle of the deletion leaves no half-deleted run
        # (a checkpoint whose COMPLETE marker outlived its weights) where a rerun would take it
        aside = path.with_name(f".{path.name}.removing")
        if aside.is_dir() and not aside.is_symlink():
            shutil.rmtree(aside)  # what an earlier stopped removal left
        os.replace(path, aside)
        shutil.rmtree(aside)
    else:
        path.unlink()


def check_answers_file(cfg) -> None:
    """Refuse to skip regeneration when the existing answers are not this recipe's."""
    from draftforge.data.regenerate import RegenerationError
    from draftforge.splitserve.producer import load_source_conversations

    try:
        load_source_conversations(cfg)
    except RegenerationError as err:
        raise DemoError(f"{err}\n(or rerun the demo with --force to start over)", exit_status=2) from None


def check_training_data(cfg) -> None:
    """Read ``data.train_files`` as the first stage that reads them will (the prompts to
    answer, or the conversations trained as they are), overlap check included, so that a
    missing or broken file is refused before ``--force`` deletes the earlier outputs."""
    from draftforge.data.loading import load_prompts, load_training_conversations

    if cfg.data.regenerate:
        load_prompts(cfg.data)
    else:
        load_training_conversations(cfg.data, cfg.train.output_dir)


def answers_digest(paths: DemoPaths, cfg) -> str | None:
    """The digest of what the trainings read: the regenerated answers, or where the recipe
    does not regenerate, its data.train_files in their order; None while a file is missing
    (the training then says which)."""
    import hashlib

    if paths.data_file is not None:
        return _digest(paths.data_file) if paths.data_file.is_file() else None
    from draftforge.data.loading import DataFormatError, resolve_data_path

    parts = []
    for spec in cfg.data.train_files:
        try:
            parts.append(f"{spec}\0{_digest(resolve_data_path(spec))}")
        except (DataFormatError, OSError):
            return None
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def runs_as_they_are(trainings: Sequence[tuple], answers: str | None,
                     other_options: dict[str, tuple[str, str]], *,
                     regenerated: bool = True) -> dict[str, Path]:
    """--skip-train: each run's checkpoint to evaluate (its final one, else its newest),
    refusing runs of another recipe or answers, or without a checkpoint."""
    from draftforge.train.checkpoint import complete_checkpoints

    checkpoints = {}
    for what, run_dir, run_cfg, _ in trainings:
        check_same_recipe(run_dir, run_cfg.to_yaml(), what, skip_train=True, other_option=other_options.get(what))
        done = final_checkpoint(run_dir, run_cfg.train.steps)
        if done is None:
            found = complete_checkpoints(run_dir)
            if not found:  # before anything is said of the run's answers
                raise DemoError(f"--skip-train: {run_dir} has no complete checkpoint; train it first",
                                exit_status=2)
            done = found[-1]
        check_trained_on(run_dir, answers, what, skip_train=True, regenerated=regenerated)
        checkpoints[what] = done
    return checkpoints


@contextlib.contextmanager
def trainings_held(trainings: Sequence[tuple]):
    """--skip-train: hold each run folder's training lock (``RUN/.train.lock``, which
    ``draftforge train`` holds while it trains there) while the block runs, so that the
    checkpoint the demo picks is not followed by newer ones (or pruned) while it is exported and
    evaluated; a run being trained now is refused, naming the process."""
    from draftforge.files import lock_or_refuse
    from draftforge.train.checkpoint import RUN_LOCK

    with contextlib.ExitStack() as stack:
        for what, run_dir, _, _ in trainings:
            if not Path(run_dir).is_dir():  # nothing to hold: runs_as_they_are refuses it
                continue
            lock = Path(run_dir).absolute() / RUN_LOCK
            stack.enter_context(lock_or_refuse(lock, lambda holder, what=what, run_dir=run_dir, lock=lock: DemoError(
                f"--skip-train: the {what} run {run_dir} is being trained ({holder} holds {lock}), so "
                "its newest checkpoint changes while the demo would export and evaluate it; wait for "
                "the training to end (or stop it), then rerun", exit_status=2)))
        yield


def checkpoint_fingerprints(checkpoint: Path) -> set[str] | None:
    """The ``draft_fingerprint`` values an evaluation of ``checkpoint`` (or of an export of it)
    records; None where its weights cannot be read (then nothing is compared)."""
    from safetensors import SafetensorError

    from draftforge.train.export import load_training_checkpoint
    from draftforge.train.export_cli import _fingerprints

    try:
        cfg, state = load_training_checkpoint(checkpoint)
        return _fingerprints(state, cfg)
    except (OSError, ValueError, KeyError, SafetensorError):
        return None


def measured_other_weights(report: dict, fingerprints: set[str] | None) -> str | None:
    """The fingerprint of the weights an evaluation report measured, where they are known not to
    be ``fingerprints``' (the chosen checkpoint's); None where they are, or where either is
    unknown."""
    measured = report.get("draft_fingerprint") if isinstance(report, dict) else None
    if fingerprints is None or not isinstance(measured, str) or measured in fingerprints:
        return None
    return measured


def export_holds_other_weights(export_dir: Path, fingerprints: set[str] | None) -> bool:
    """Whether the export folder is known to hold other weights than ``fingerprints``'."""
    if fingerprints is None:
        return False
    from safetensors import SafetensorError

    from draftforge.train.hf_load import export_fingerprint

    try:
        return export_fingerprint(export_dir) not in fingerprints
    except (OSError, ValueError, KeyError, SafetensorError):  # unreadable: nothing compared
        return False


def model_card_is_current(paths: DemoPaths) -> bool:
    """The export's model card was written after the DSpark evaluation finished: report.json
    marks that (written last; a report.md newer than it is an unfinished evaluation's)."""
    return mtime(paths.export_dir / "README.md") >= mtime(paths.eval_dir / "report.json")
