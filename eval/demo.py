"""``draftforge demo [RECIPE]``: regenerate, train DSpark and DFlash, export, evaluate, one table.

The README's main command (``make demo``). With the default CPU recipe
(``recipes/smollm2-cpu.yaml``) it runs, each stage a ``draftforge`` subcommand
in its own process:

1. ``data regenerate``: the target answers the recipe's prompts once, into the run's
   regenerated file (``data.regenerated_file``, default ``<run>/regenerated.jsonl``);
   both trainings read that file instead of regenerating on the fly;
2. ``train``: the DSpark draft, as the recipe says, except that its Markov head starts as
   the regenerated answers' bigram table (``train.markov_init=bigram``, +0.03-0.04 AL at
   the CPU recipe's budget), which the answers existing before training allows;
   ``--markov-init random`` keeps the recipe's start. Drafts without a vanilla or gated
   Markov head, and recipes that do not regenerate, keep theirs;
3. ``train``: the DFlash ablation, with the same recipe and budget and these overrides
   only: no Markov head, no confidence head, the pure cross-entropy objective, and
   its own run directory ``<run>-dflash`` (:data:`DFLASH_OVERRIDES`);
4. ``export``: the DSpark draft to ``export.out_dir`` (default ``<run>/export``);
5. ``eval`` (greedy, float32 target): the export against the no-draft and n-gram
   baselines on the same prompts in one run (``<run>/eval``), and the DFlash ablation
   from its training checkpoint on the same prompts (``<run>/eval-dflash``; SGLang
   refuses ``markov_rank: 0``, so it has no DSpark export). Both verify every drafted token
   (``--verify full``: DFlash has no confidence head, and the table subtracts one from the
   other), whatever the recipe's ``eval.verify``. The two run side by side on machines with
   two or more cores and no GPU, one thread each, else one after the other;
6. the export again, its model card now holding the measured table; then one
   markdown table, printed and written to ``<run>/demo.md``. The last line is::

       export_dir=<path> al_dspark=<macro> al_dflash=<macro> al_ngram=<macro>

A stage whose output already exists, is complete and is newer than its inputs is
skipped, so an interrupted demo continues where it stopped (training resumes from
its newest checkpoint). An existing regenerated file is used only if it answers the
recipe's prompts with its target and generation settings; otherwise the demo stops and
says what differs. ``--force`` starts over; ``--skip-train`` uses the runs as they are.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from draftforge import argtypes
from draftforge.cores import usable_cores
from draftforge.files import write_atomic
from draftforge.precision import cpu_bf16_flags
from draftforge.signals import interrupts_held
from draftforge.splitserve.supervisor import terminal_sent_it_to_the_group, unwinding_on_sigterm

DEFAULT_RECIPE = "recipes/smollm2-cpu.yaml"
WORKLOADS = ("humaneval", "mtbench", "gsm8k")
# Prompts per workload when the recipe's eval.num_prompts is unset (all prompts would take
# hours on a CPU). The recipe's eval section gives the defaults otherwise: smollm2-cpu.yaml's
# 8 prompts x 128 tokens keep the whole demo at about an hour on 2 cores with native bf16 (64 min on
# 2026-12-03: regeneration 11, the two trainings 18 and 12, the two evaluations side by side 22).
FALLBACK_NUM_PROMPTS = 8
# DFlash = the same draft without the Markov and confidence heads, trained on pure
# cross-entropy. Everything else (data, steps, anchors, lr, layers) stays the recipe's.
# (No Markov head, so no bigram start either; and no KL term, whatever the recipe sets.)
DFLASH_OVERRIDES = (
    "draft.markov_rank=0",
    "draft.enable_confidence_head=false",
    "draft.confidence_head_with_markov=false",
    "train.markov_init=random",
    "train.loss.ce_weight=1",
    "train.loss.tv_weight=0",
    "train.loss.bce_weight=0",
    "train.loss.kl_weight=0",
)
ANSWERS_STAMP = "demo-answers.json"  # in each run folder: the digest of the answers it trained on


class DemoError(RuntimeError):
    """A stage failed or the outputs on disk belong to another run; the message says what to do.

    ``exit_status`` is the demo's: 2 when the input is at fault (outputs of another run or
    recipe, an option that cannot apply, a stage that itself refused its input with 2), as for
    every draftforge command; 1 for a failure."""

    def __init__(self, message: str, *, exit_status: int = 1):
        super().__init__(message)
        self.exit_status = exit_status


@dataclass(frozen=True)
class DemoPaths:
    """Everything the demo reads and writes, derived from the recipe."""

    run_dir: Path
    dflash_dir: Path
    data_file: Path | None  # None when the recipe trains on its files as they are
    export_dir: Path
    eval_dir: Path
    dflash_eval_dir: Path
    log_dir: Path
    table: Path


def demo_paths(cfg) -> DemoPaths:
    """The demo's paths for a loaded recipe (a ``RecipeConfig``)."""
    from draftforge.data.loading import regenerated_path

    run_dir = Path(cfg.train.output_dir)
    return DemoPaths(
        run_dir=run_dir,
        dflash_dir=run_dir.with_name(run_dir.name + "-dflash"),
        data_file=regenerated_path(cfg.data, run_dir) if cfg.data.regenerate else None,
        # expanded as draftforge export expands it: a "~/..." folder is the one the export writes
        export_dir=Path(cfg.export.out_dir).expanduser() if cfg.export.out_dir else run_dir / "export",
        eval_dir=run_dir / "eval",
        dflash_eval_dir=run_dir / "eval-dflash",
        log_dir=run_dir / "demo-logs",
        table=run_dir / "demo.md",
    )


def dspark_overrides(cfg, paths: DemoPaths, markov_init: str) -> tuple[list[str], str]:
    """The DSpark training's overrides and a line saying how its Markov head starts.

    ``bigram`` applies where it can: the answers exist before training (the demo
    regenerates them first) and the head is a vanilla or gated table."""
    if markov_init == "random":
        return [], f"the recipe's ({cfg.train.markov_init}), as --markov-init random asks"
    if paths.data_file is None:
        return [], f"the recipe's ({cfg.train.markov_init}): no regenerated answers to count"
    if not cfg.draft.has_markov_table:
        return [], (
            f"the recipe's ({cfg.train.markov_init}): a bigram start needs a vanilla or gated "
            f"head (this draft: rank {cfg.draft.markov_rank}, {cfg.draft.markov_head_type})"
        )
    return ["train.markov_init=bigram"], "the regenerated answers' bigram table"


def dflash_overrides(paths: DemoPaths) -> list[str]:
    """The DFlash ablation's overrides: its objective and architecture, its own run
    directory, and the DSpark run's regenerated data (so it trains on the same answers)."""
    overrides = [*DFLASH_OVERRIDES, _path_override("train.output_dir", paths.dflash_dir)]
    if paths.data_file is not None:
        overrides.append(_path_override("data.regenerated_file", paths.data_file))
    return overrides


def _path_override(key: str, path: Path) -> str:
    """``key=PATH``, the path quoted where an override's YAML would read it as something else
    (``/exp #3/run`` as ``/exp``, ``/a: b/run`` as a mapping)."""
    from draftforge.config import RecipeError, parse_override

    plain = f"{key}={path}"
    try:
        if parse_override(plain)[1] == str(path):
            return plain
    except RecipeError:
        pass
    return f"{key}={json.dumps(str(path), ensure_ascii=False)}"


# -- stages ----------------------------------------------------------------------------


class Stages:
    """Numbered banners, elapsed times and the subprocesses of each stage."""

    def __init__(self, total: int, out: Callable[[str], None] = print):
        self.total = total
        self.number = 0
        self.skipped = 0
        self.out = out
        self.started = time.perf_counter()

    def banner(self, title: str) -> float:
        self.number += 1
        self.out(f"\n==> [{self.number}/{self.total}] {title}")
        return time.perf_counter()

    def skip(self, why: str, *, done_earlier: bool = True) -> None:
        """``done_earlier``: an earlier run did the stage (False: it has nothing to do, and this
        run's time is still the whole demo's)."""
        self.skipped += done_earlier
        self.out(f"    skipped: {why}")

    def elapsed(self) -> str:
        """This invocation's time, said not to be the whole demo's when stages were skipped."""
        took = _minutes(time.perf_counter() - self.started)
        if not self.skipped:
            return f"whole demo {took}"
        return (f"this run {took}, not the whole demo's time: {self.skipped} of {self.total} "
                "stages were skipped, done by an earlier run")

    def done(self, since: float) -> None:
        now = time.perf_counter()
        so_far = "this run so far" if self.skipped else "demo so far"
        self.out(f"    done in {_minutes(now - since)} ({so_far}: {_minutes(now - self.started)})")


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"


def draftforge_command(*args: str) -> list[str]:
    """A ``draftforge`` subcommand run by this interpreter (no PATH lookup)."""
    return [sys.executable, "-m", "draftforge", *args]


def run_stage(name: str, args: Sequence[str], *, env: dict[str, str] | None = None,
              indent: bool = False) -> None:
    """Run ``draftforge ARGS`` with its output on the terminal; a failure raises DemoError.
    ``indent``: its standard output indented under the command line, as the stage's own (the
    export's ``export_dir=`` line must not read as the demo's last line to a script)."""
    command = draftforge_command(*args)
    print(f"    $ draftforge {shlex.join(args)}", flush=True)
    if indent:  # unbuffered: its lines keep their order with its messages on the terminal
        env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    proc: subprocess.Popen | None = None
    try:
        with interrupts_held():  # one landing inside Popen would leave the stage running
            proc = subprocess.Popen(command, env=env, **(
                {"stdout": subprocess.PIPE, "text": True, "bufsize": 1, "errors": "replace"}
                if indent else {}))
        for line in proc.stdout if indent else ():
            print(f"    {line.rstrip()}", flush=True)
        status = proc.wait()
    except BaseException as stop:  # Ctrl-C, SIGTERM (JobInterrupted)
        if proc is not None:
            _stop_stage(proc, stop)
        raise
    if status != 0:
        raise DemoError(
            f"stage '{name}' failed (exit status {status}): draftforge {shlex.join(args)}\n"
            "The messages above say why; fix it and rerun the demo (finished stages are skipped).",
            exit_status=_passed_on(status),
        )


def _passed_on(*statuses: int) -> int:
    """The demo's exit status for failed stages: 2 when every one refused its input (status 2),
    else 1."""
    return 2 if all(status == 2 for status in statuses) else 1


def _stop_stage(proc: subprocess.Popen, why: BaseException) -> None:
    """Stop a stage the way the demo was stopped and wait for it to end: a training stage's
    launcher then stops its ranks, where a SIGKILL (``subprocess.call`` on Ctrl-C) or no
    signal at all (SIGTERM) would leave them running."""
    if proc.poll() is None:
        if not isinstance(why, KeyboardInterrupt):
            proc.terminate()
        elif not terminal_sent_it_to_the_group():  # else the stage has had the SIGINT already
            proc.send_signal(signal.SIGINT)
    try:
        proc.wait()
    except BaseException:  # asked again while waiting: no more waiting
        proc.kill()
        proc.wait()
        raise


def run_side_by_side(jobs: dict[str, Sequence[str]], log_dir: Path, *, parallel: bool) -> None:
    """Run several ``draftforge`` commands at once (or one after another), each line of
    their output prefixed with the job's label and copied to ``log_dir/<label>.log``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
    lock = threading.Lock()

    def start(label: str, args: Sequence[str]):
        print(
            f"    $ draftforge {shlex.join(args)}   (log: {log_dir / (label + '.log')})", flush=True
        )
        proc = subprocess.Popen(
            draftforge_command(*args), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1, errors="replace",
        )  # fmt: skip

        def pump():
            # The full report each evaluation prints goes to its log only: two of them
            # interleaved on the terminal would be unreadable (the demo prints its own table).
            in_report = False
            with open(log_dir / f"{label}.log", "w") as log:
                for line in proc.stdout:
                    log.write(line)
                    in_report = (
                        in_report or line.startswith("Command: `")
                    ) and not line.startswith("eval: report in")
                    if not in_report:
                        with lock:
                            print(f"    [{label}] {line.rstrip()}", flush=True)

        thread = threading.Thread(target=pump, daemon=True)
        thread.start()
        return proc, thread

    running: dict[str, tuple[subprocess.Popen, threading.Thread]] = {}
    failures = []
    try:
        for label, args in jobs.items():
            with interrupts_held():  # one landing inside Popen would leave the job unstopped
                running[label] = start(label, args)
            if not parallel:
                _finish(label, *running[label], failures)
        if parallel:
            for label, (proc, thread) in running.items():
                _finish(label, proc, thread, failures)
    finally:
        for proc, _ in running.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
    if failures:
        details = "; ".join(
            f"'{label}' exited with status {status}{' (greedy output not lossless)' if status == 3 else ''}, "
            f"log {log_dir / (label + '.log')}"
            for label, status in failures
        )
        raise DemoError(f"evaluation failed: {details}\nThe logs say why; fix it and rerun the demo "
                        "(finished stages are skipped, and so is an evaluation that finished).",
                        exit_status=_passed_on(*(status for _, status in failures)))


def _finish(label: str, proc: subprocess.Popen, thread: threading.Thread, failures: list) -> None:
    status = proc.wait()
    thread.join()
    if status != 0:
        failures.append((label, status))


# -- what is already done --------------------------------------------------------------


def _mtime(path: Path) -> float:
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


TRAINING_ONLY_AFTER = ("eval", "export")  # sections that do not change what a training run is


def _training_part(recipe_yaml: str) -> str:
    """The recipe without the sections read only after training, so that editing how the
    demo evaluates or exports does not call a finished training run another recipe's."""
    import yaml

    try:
        data = yaml.safe_load(recipe_yaml)
    except yaml.YAMLError:
        return recipe_yaml
    if not isinstance(data, dict):
        return recipe_yaml
    return yaml.safe_dump({k: v for k, v in data.items() if k not in TRAINING_ONLY_AFTER}, sort_keys=False)


SKIP_TRAIN_FIX = "--skip-train uses the runs as they are: undo the edit, or drop --skip-train and pass --force"


def check_same_recipe(run_dir: Path, expected_yaml: str, what: str, *, skip_train: bool = False,
                      other_option: tuple[str, str] | None = None) -> None:
    """Refuse to resume or reuse a run directory that holds a run of another recipe (its
    eval and export sections aside). ``skip_train``: the demo would not train, so --force
    (which then keeps the runs) is no fix. ``other_option``: a demo option and the recipe it
    would train (``--markov-init``), named as the fix when the run is that recipe's."""
    from draftforge.train import checkpoint as ckpt

    saved = run_dir / "config.yaml"
    if not ckpt.complete_checkpoints(run_dir) or not saved.is_file():
        return
    old_text, new_text = _training_part(_resolved_again(saved)), _training_part(expected_yaml)
    if other_option is not None and old_text != new_text and old_text == _training_part(other_option[1]):
        raise DemoError(
            f"{run_dir} holds the {what} run of this recipe trained with {other_option[0]}: pass "
            f"{other_option[0]} to use it"
            + ("" if skip_train else ", or --force to train again from scratch (it deletes that run)"),
            exit_status=2,
        )
    if old_text != new_text:
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
            + (f"{SKIP_TRAIN_FIX}." if skip_train else "Rerun with --force to train again from "
               "scratch (it deletes that run), or move the folder away."),
            exit_status=2,
        )


def _same_command(recorded: str | list | None, args: Sequence[str]) -> bool:
    """Whether a recorded command is ``args``, however the recipe's path was spelt."""
    if isinstance(recorded, str):
        recorded = shlex.split(recorded)[1:] if recorded.startswith("draftforge ") else None
    if not isinstance(recorded, list):
        return False

    def normal(argv: Sequence[str]) -> list[str]:
        return [os.path.realpath(a) if i and argv[i - 1] == "--recipe" else a for i, a in enumerate(argv)]

    return normal(recorded) == normal(list(args))


def eval_is_current(eval_dir: Path, args: Sequence[str], newer_than: Path, settings: dict | None = None) -> bool:
    """An evaluation report written by exactly this command after its draft was made, with
    ``settings`` (what the command takes from the recipe's eval section) as its own."""
    report = eval_dir / "report.json"
    if not report.is_file() or _mtime(report) < _mtime(newer_than):
        return False
    try:
        written = json.loads(report.read_text())
    except json.JSONDecodeError:
        return False
    if not _same_command(written.get("command"), ["eval", *args]):
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


def stamp_answers(run_dir: Path, answers: str, what: str) -> None:
    """Record the answers a training is about to train on; a run that already has
    checkpoints must have trained on these (a resume), one without any may start afresh."""
    from draftforge.train.checkpoint import complete_checkpoints

    if complete_checkpoints(run_dir):
        _check_trained_on(run_dir, answers, what)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / ANSWERS_STAMP, json.dumps({"sha256": answers}))


def _check_trained_on(run_dir: Path, answers: str | None, what: str, *, skip_train: bool = False) -> None:
    """Refuse a run trained (or being trained) on other answers than the file holds now: the
    file was regenerated since (another machine's threads give other answers in bf16). Runs
    from before the record are not checked."""
    try:
        recorded = json.loads((run_dir / ANSWERS_STAMP).read_text()).get("sha256")
    except (OSError, json.JSONDecodeError, AttributeError):
        return
    if answers is not None and recorded != answers:
        raise DemoError(
            f"{run_dir}: the {what} draft was trained on other answers than the regenerated file "
            "holds now (it was written again since); "
            + ("--skip-train uses the runs as they are: drop --skip-train and pass --force to "
               "train on these answers" if skip_train else
               "rerun the demo with --force to train on these answers"),
            exit_status=2,
        )


def export_files(export_dir: Path) -> str:
    """The digest of an export folder's files but its model card (the last stage writes it again):
    its config and weights, the same for every export of one checkpoint by one command."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(export_dir.glob("*")):
        if path.name != "README.md" and path.is_file():
            content = hashlib.sha256()  # hashlib.file_digest needs Python 3.11
            with path.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    content.update(block)
            digest.update(path.name.encode() + content.digest())
    return digest.hexdigest()


def export_is_current(paths, export_args: Sequence[str], checkpoint: Path) -> bool:
    """The export folder was written by exactly this command after the draft's last checkpoint,
    and holds what it wrote: not another export since (``draftforge export`` of an earlier
    checkpoint writes to the same folder by default)."""
    stamp = paths.run_dir / EXPORT_STAMP
    if _mtime(paths.export_dir / "config.json") < _mtime(checkpoint / "COMPLETE"):
        return False
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if not _same_command(recorded.get("command"), export_args):
        return False
    files = recorded.get("files")  # stamps written before the digest: not checked
    return files is None or files == export_files(paths.export_dir)


def _remove(path: Path, keep: Sequence[Path]) -> None:
    """Delete a demo output (file or folder), refusing folders that hold what must stay."""
    if not path.exists():
        return
    resolved = path.resolve()
    for other in keep:
        other = other.resolve()
        if resolved == other or resolved in other.parents:
            raise DemoError(f"--force would delete {path}, which holds {other}; refusing", exit_status=2)
    print(f"    --force: removing {path}")
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


# -- the table ----------------------------------------------------------------------------


def _fmt(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}"


def _mean(values: Sequence[float | None]) -> float:
    clean = [v for v in values if v is not None and math.isfinite(v)]
    return sum(clean) / len(clean) if clean and len(clean) == len(values) else math.nan


def table_rows(dspark_report: dict, dflash_report: dict) -> list[dict]:
    """One row per workload of the DSpark report, plus the macro mean (unweighted over workloads)."""
    rows = []
    for name, entry in dspark_report["workloads"].items():
        methods = entry["methods"]
        dflash = dflash_report["workloads"].get(name, {}).get("methods", {}).get("dspark", {})
        estimate = entry.get("train_time_estimate") or {}
        rows.append({
            "workload": name,
            "dspark": methods.get("dspark", {}).get("acceptance_length"),
            "dflash": dflash.get("acceptance_length"),
            "ngram": methods.get("ngram", {}).get("acceptance_length"),
            "none_tps": methods.get("none", {}).get("tokens_per_s"),
            "dspark_tps": methods.get("dspark", {}).get("tokens_per_s"),
            "tau": estimate.get("tau"),
        })  # fmt: skip
    keys = ("dspark", "dflash", "ngram", "none_tps", "dspark_tps", "tau")
    rows.append({"workload": "macro mean", **{k: _mean([r[k] for r in rows]) for k in keys}})
    return rows


def markdown_table(rows: Sequence[dict]) -> str:
    """The demo's table: acceptance lengths, speeds and the train-time estimate per workload."""
    lines = [
        "| workload | DSpark AL | DFlash AL | n-gram AL | no-draft tok/s | DSpark tok/s | train-time tau |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        speedup = (
            f" ({r['dspark_tps'] / r['none_tps']:.2f}x)"
            if r["none_tps"] and r["dspark_tps"] and math.isfinite(r["none_tps"] * r["dspark_tps"])
            else ""
        )
        name = f"**{r['workload']}**" if r["workload"] == "macro mean" else r["workload"]
        lines.append(
            f"| {name} | {_fmt(r['dspark'])} | {_fmt(r['dflash'])} | {_fmt(r['ngram'])} | "
            f"{_fmt(r['none_tps'], 1)} | {_fmt(r['dspark_tps'], 1)}{speedup} | {_fmt(r['tau'])} |"
        )
    return "\n".join(lines)


def lead_table(dspark: tuple[Path, dict], dflash: tuple[Path, dict]) -> str:
    """DSpark minus n-gram and minus DFlash, per workload and macro, with paired bootstrap
    intervals over the prompts (:mod:`draftforge.eval.uncertainty`). A comparison that
    ``draftforge eval compare`` would refuse (other prompts, other decoding settings) gets a
    line saying why instead of its row."""
    from draftforge.errors import InputError
    from draftforge.eval.compare import check_same_decoding, paired_totals
    from draftforge.eval.uncertainty import LEVEL, by_workload, interval_text

    comparisons, refused = {}, []
    for label, other, method in (("DSpark - n-gram", dspark, "ngram"), ("DSpark - DFlash", dflash, "dspark")):
        try:
            pairs = paired_totals(dspark, "dspark", other, method)
            check_same_decoding(dspark, "dspark", other, method)
        except InputError as err:
            refused.append(f"(No intervals for {label}: {err}.)")
        else:
            comparisons[label] = pairs
    if not comparisons:
        return "\n\n".join(refused)
    names = list(next(iter(comparisons.values())))
    lines = [
        f"Is DSpark ahead? Differences in AL, paired on the same prompts, with {LEVEL:.0%} "
        "bootstrap intervals over the prompts (`draftforge eval compare`):",
        "",
        "| comparison | " + " | ".join(names) + " | macro mean | verdict (macro) |",
        "| --- |" + " ---: |" * (len(names) + 1) + " --- |",
    ]
    for label, pairs in comparisons.items():
        cells = by_workload(pairs)  # the workloads, then "macro"
        text = " | ".join(interval_text(c.value, c.low, c.high, signed=True) for c in cells.values())
        lines.append(f"| {label} | {text} | {cells['macro'].verdict()} |")
    return "\n".join(lines + [line for why in refused for line in ("", why)])


def recorded_devices(*reports: dict) -> list[str]:
    """The devices the evaluations ran on, as their report.json files record them."""
    devices = []
    for report in reports:
        devices += report.get("target_devices") or ([report["device"]] if report.get("device") else [])
    return list(dict.fromkeys(devices))


def _machine(devices: Sequence[str]) -> str:
    """The machine, with the devices the evaluations recorded (``draftforge eval --device
    auto`` takes a GPU where one is visible)."""
    model = platform.processor() or platform.machine()
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""  # not Linux: no model name, no flags
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    flags = cpu_bf16_flags(cpuinfo)
    bf16 = f"native bf16: {', '.join(flags)}" if flags else "no native bf16"
    if not devices:
        evaluated = "the evaluations' device not recorded"
    elif all(d == "cpu" for d in devices):
        evaluated = "evaluated on the CPU, no GPU used"
    else:
        evaluated = f"evaluated on {', '.join(devices)}"
    return f"{usable_cores()} cores ({model}, {bf16}), {platform.system()}, {evaluated}"


SAME_SITTING_S = 3600  # evaluations finished closer together than this get one date


def measured_when(dspark_finished: float, dflash_finished: float) -> str:
    """When the two evaluations finished (POSIX times): the later one's date, or both when
    an interrupted demo finished them in different sittings."""
    def utc(stamp: float) -> str:
        return datetime.fromtimestamp(stamp, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    if abs(dspark_finished - dflash_finished) < SAME_SITTING_S:
        return utc(max(dspark_finished, dflash_finished))
    return f"{utc(dspark_finished)} (DSpark evaluation), {utc(dflash_finished)} (DFlash evaluation)"


def _count(n: int, noun: str) -> str:
    """``1 prompt``, ``8 prompts``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _prompts_text(asked: int, prompts: dict[str, int] | None) -> str:
    """How many prompts the evaluations ran: ``--num-prompts`` takes all of a workload that
    has fewer (MT-Bench has 80)."""
    if not prompts or all(n == asked for n in prompts.values()):
        return f"{_count(asked, 'prompt')} per workload"
    each = ", ".join(f"{name} {n}" for name, n in prompts.items())
    return f"prompts per workload: {each} (all of a workload with fewer than the {asked} asked)"


def _training_tau(run_dir: Path) -> float | None:
    summary = run_dir / "summary.json"
    if not summary.is_file():
        return None
    return json.loads(summary.read_text()).get("tau")


def demo_markdown(
    table: str,
    *,
    command: str,
    cfg,
    paths: DemoPaths,
    num_prompts: int,
    max_new_tokens: int,
    block_size: int,
    trained: dict[str, int] | None = None,
    stopped: dict[str, str] | None = None,
    skip_train: bool = False,
    devices: Sequence[str] = (),
    prompts: dict[str, int] | None = None,
) -> str:
    """demo.md: the table with the command, date, machine and what the numbers mean;
    ``prompts``: the prompts each workload was evaluated on (report.json), fewer than
    ``num_prompts`` where a workload has fewer;
    ``trained``: the steps of the checkpoint each draft was evaluated at, short of the
    recipe's where ``stopped`` names the draft's stop reason (``data_exhausted``: its
    training ran out of data) or ``skip_train`` evaluated an unfinished run; ``devices``:
    where the evaluations ran (:func:`recorded_devices`)."""
    steps = cfg.train.steps
    budget = f"Both drafts: {steps} steps of the recipe"
    if trained and any(n != steps for n in trained.values()):
        why = []
        for what, n in trained.items():
            if n == steps:
                continue
            if (stopped or {}).get(what) == "data_exhausted":
                why.append(f"{what} stopped at step {n}: the data ran out")
            else:
                why.append("--skip-train: an unfinished run" if skip_train else f"{what}: an unfinished run")
        budget = ("Drafts evaluated at " + ", ".join(f"{what} step {n}" for what, n in trained.items())
                  + f" of the recipe's {steps} ({'; '.join(dict.fromkeys(why))}; not the full budget)")
    verified = "every drafted token verified (`--verify full`, for both drafts: DFlash has no confidence head)"
    if cfg.eval.verify == "threshold":
        verified += "; the recipe's `eval.verify: threshold` is not applied"
    taus = (_training_tau(paths.run_dir), _training_tau(paths.dflash_dir))
    # when the evaluations finished (a rerun that skips every stage keeps those dates)
    measured = measured_when(_mtime(paths.eval_dir / "report.json"),
                             _mtime(paths.dflash_eval_dir / "report.json"))
    return "\n".join(
        [
            f"# draftforge demo: {cfg.name}",
            "",
            f"Command: `{command}`  ",
            f"Measured: {measured}; machine: {_machine(devices)}.",
            "",
            f"Target `{cfg.target.model}` (evaluated in float32), greedy decoding (checked lossless "
            f"against plain decoding), {verified}, {_prompts_text(num_prompts, prompts)}, up to {max_new_tokens} new "
            f"tokens, blocks of {block_size}. {budget} in "
            f"{cfg.train.dtype} (target features in {cfg.target.dtype}); "
            f"DFlash = the same recipe with `{' '.join(DFLASH_OVERRIDES)}`"
            + (
                "; DSpark's Markov head started as the training answers' bigram table "
                "(`train.markov_init=bigram`)."
                if cfg.train.markov_init == "bigram"
                else "."
            ),
            "",
            table,
            "",
            f"AL: mean acceptance length per verification round (accepted drafts + 1 bonus token; "
            f"no draft = 1.00, at most {block_size + 1}). Tokens/s are measured in one process on the "
            "same prompts (the speed-up is DSpark over no draft; the macro row's, the ratio of its two "
            "mean speeds). Train-time tau: the training "
            "metric on the evaluation prompts (see the eval report). At the end of training, tau on "
            f"the training data was {_fmt(taus[0])} (DSpark) and {_fmt(taus[1])} (DFlash).",
            "",
            f"Reports: `{paths.eval_dir}/report.md` (DSpark and baselines), "
            f"`{paths.dflash_eval_dir}/report.md` (DFlash); export: `{paths.export_dir}`.",
            "",
        ]
    )


# -- the command ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftforge demo",
        description="End to end: regenerate the recipe's data, train the DSpark draft and the "
        "DFlash ablation, export, evaluate against the baselines, print one table. Finished "
        "stages are skipped when rerun.",
    )
    parser.add_argument(
        "recipe", nargs="?", default=DEFAULT_RECIPE, help=f"default {DEFAULT_RECIPE}"
    )
    parser.add_argument(
        "--num-prompts",
        type=argtypes.positive_int,
        help="prompts per workload (default: the recipe's eval.num_prompts, "
        f"or {FALLBACK_NUM_PROMPTS} when it is unset)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=argtypes.positive_int,
        help="tokens generated per prompt, 2 or more (default: the recipe's eval.max_new_tokens)",
    )
    parser.add_argument("--workloads", type=argtypes.names(WORKLOADS),
                        help=f"comma-separated subset of {','.join(WORKLOADS)} (default: the recipe's "
                        "eval.workloads)")  # fmt: skip
    parser.add_argument(
        "--skip-train",
        action="store_true",
        help="use the trained runs as they are (no regeneration, no training)",
    )
    parser.add_argument(
        "--markov-init",
        choices=("bigram", "random"),
        default="bigram",
        help="how DSpark's Markov head starts: bigram (default) = train.markov_init=bigram, the "
        "regenerated answers' bigram table, where the draft's head allows it; random = the "
        "recipe's own train.markov_init",
    )
    parser.add_argument("--force", action="store_true",
                        help="redo every stage: deletes the demo's runs (with --skip-train: only "
                        "the export and evaluations)")  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``draftforge demo``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)  # a wrong option: argparse's usage error, status 2
    # SIGTERM unwinds like Ctrl-C, so the running stage (a whole training job) is stopped too
    with unwinding_on_sigterm("\ndraftforge demo",
                              "rerun the same command to continue (finished stages are skipped)"):
        try:
            return run_demo(args, command=" ".join(["draftforge demo", *map(shlex.quote, argv)]))
        except DemoError as err:
            print(f"\ndraftforge demo: {err}", file=sys.stderr)
            return err.exit_status


def _check_answers_file(cfg) -> None:
    """Refuse to skip regeneration when the existing answers are not this recipe's."""
    from draftforge.data.regenerate import RegenerationError
    from draftforge.splitserve.producer import load_source_conversations

    try:
        load_source_conversations(cfg)
    except RegenerationError as err:
        raise DemoError(f"{err}\n(or rerun the demo with --force to start over)", exit_status=2) from None


def _answers_digest(paths: DemoPaths) -> str | None:
    """The digest of the regenerated answers the trainings read, None while there are none."""
    return _digest(paths.data_file) if paths.data_file is not None and paths.data_file.is_file() else None


def _runs_as_they_are(trainings: Sequence[tuple], answers: str | None,
                      other_options: dict[str, tuple[str, str]]) -> dict[str, Path]:
    """--skip-train: each run's checkpoint to evaluate (its final one, else its newest),
    refusing runs of another recipe or answers, or without a checkpoint."""
    from draftforge.train.checkpoint import complete_checkpoints

    checkpoints = {}
    for what, run_dir, run_cfg, _ in trainings:
        check_same_recipe(run_dir, run_cfg.to_yaml(), what, skip_train=True, other_option=other_options.get(what))
        _check_trained_on(run_dir, answers, what, skip_train=True)
        done = final_checkpoint(run_dir, run_cfg.train.steps)
        if done is None:
            found = complete_checkpoints(run_dir)
            if not found:
                raise DemoError(f"--skip-train: {run_dir} has no complete checkpoint; train it first",
                                exit_status=2)
            done = found[-1]
        checkpoints[what] = done
    return checkpoints


def evaluation_commands(recipe: str, paths: DemoPaths, *, workloads: Sequence[str], num_prompts: int,
                        max_new_tokens: int) -> tuple[list[str], list[str]]:
    """The two ``draftforge eval`` commands: the same prompts and decoding, every drafted
    token verified (DFlash has no confidence head to cut its blocks at a threshold, and the
    table subtracts one from the other, so DSpark's is not the recipe's ``eval.verify``
    either), DSpark beside the baselines the table shows."""
    common = [
        "--recipe", recipe, "--dtype", "float32", "--temperature", "0",
        "--workloads", ",".join(workloads), "--num-prompts", str(num_prompts),
        "--max-new-tokens", str(max_new_tokens),
    ]  # fmt: skip
    eval_args = ["eval", str(paths.export_dir), *common, "--baselines", "none,ngram", "--verify", "full",
                 "--out", str(paths.eval_dir)]  # fmt: skip
    dflash_args = ["eval", str(paths.dflash_dir), *common, "--baselines", "none", "--no-estimate",
                   "--verify", "full", "--out", str(paths.dflash_eval_dir)]  # fmt: skip
    return eval_args, dflash_args


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def evaluations_side_by_side() -> bool:
    """Whether the two evaluations run at once: on two or more cores, one thread each, but
    not where a GPU is visible (``draftforge eval --device auto`` takes it, and both would
    share it)."""
    return usable_cores() >= 2 and not _cuda_visible()


def model_card_is_current(paths: DemoPaths) -> bool:
    """The export's model card was written after the DSpark evaluation finished: report.json
    marks that (written last; a report.md newer than it is an unfinished evaluation's)."""
    return _mtime(paths.export_dir / "README.md") >= _mtime(paths.eval_dir / "report.json")


def run_demo(args: argparse.Namespace, *, command: str) -> int:
    """The stages (see the module docstring); prints the table and the summary line."""
    from draftforge.config import load_recipe

    recipe = args.recipe
    base = load_recipe(recipe)
    paths = demo_paths(base)
    dspark_args, markov_start = dspark_overrides(base, paths, args.markov_init)
    cfg = load_recipe(recipe, dspark_args)
    dflash_cfg = load_recipe(recipe, dflash_overrides(paths))
    args.num_prompts = args.num_prompts or cfg.eval.num_prompts or FALLBACK_NUM_PROMPTS
    # before the hour of stages whose table it would empty (a recipe's value: its schema)
    if args.max_new_tokens is not None and args.max_new_tokens < 2:
        from draftforge.errors import InputError

        raise InputError(
            f"--max-new-tokens {args.max_new_tokens}: the first new token comes from the prompt's "
            "prefill, so no verification round would run and no acceptance length be measured; "
            "give 2 or more"
        )
    args.max_new_tokens = args.max_new_tokens or cfg.eval.max_new_tokens
    # checked by argparse, the recipe by its schema; each once, as draftforge eval runs them
    workloads = list(dict.fromkeys(args.workloads or cfg.eval.workloads))
    stages = Stages(total=6)
    print(
        f"draftforge demo: recipe {recipe} (target {cfg.target.model} in {cfg.target.dtype}, "
        f"{cfg.train.steps} training steps per draft in {cfg.train.dtype}), {_count(len(workloads), 'workload')} "
        f"x {_count(args.num_prompts, 'prompt')}, "
        f"{args.max_new_tokens} new tokens; outputs under {paths.run_dir} and {paths.dflash_dir}\n"
        f"DSpark's Markov head starts as {markov_start}",
        flush=True,
    )

    trainings = (
        ("DSpark", paths.run_dir, cfg, dspark_args),
        ("DFlash", paths.dflash_dir, dflash_cfg, dflash_overrides(paths)),
    )
    # a DSpark run trained with the other --markov-init is named as such, not as another recipe's
    other_init = "random" if args.markov_init == "bigram" else "bigram"
    other_options = {"DSpark": (f"--markov-init {other_init}",
                                load_recipe(recipe, dspark_overrides(base, paths, other_init)[0]).to_yaml())}
    checkpoints: dict[str, Path] = {}
    if args.skip_train:  # checked before --force deletes anything: it keeps these runs
        checkpoints = _runs_as_they_are(trainings, _answers_digest(paths), other_options)

    if args.force:
        keep = [Path(recipe), Path.cwd()]
        outputs = [paths.export_dir, paths.eval_dir, paths.dflash_eval_dir, paths.table]
        if not args.skip_train:
            outputs = [paths.run_dir, paths.dflash_dir, paths.export_dir] + (
                [paths.data_file, paths.data_file.with_name(paths.data_file.name + ".partial")]
                if paths.data_file is not None
                else []
            )
        for path in outputs:
            _remove(path, keep)

    if paths.data_file is not None and paths.data_file.is_file() and not args.skip_train:
        _check_answers_file(cfg)
    if not args.skip_train:  # both runs now: the DFlash one not after the hour of stages before it
        for what, run_dir, run_cfg, _ in trainings:
            check_same_recipe(run_dir, run_cfg.to_yaml(), what, other_option=other_options.get(what))
    # 1. data
    since = stages.banner("regenerate the training data: the target answers the prompts")
    if args.skip_train:
        stages.skip("--skip-train")
    elif paths.data_file is None:
        stages.skip("data.regenerate is false: training uses data.train_files as they are", done_earlier=False)
    elif paths.data_file.is_file():
        stages.skip(f"{paths.data_file} already answers the recipe's prompts")
    else:
        # Its defaults: on a CPU one worker process per usable core, one thread each.
        run_stage("data regenerate", ["data", "regenerate", recipe])
        stages.done(since)

    # 2-3. the two trainings
    answers = _answers_digest(paths)
    for what, run_dir, run_cfg, overrides in trainings:
        title = f"train the {what} draft ({run_cfg.train.steps} steps) into {run_dir}" + (
            " -- the ablation: no Markov or confidence head, cross-entropy only"
            if what == "DFlash"
            else ""
        )
        since = stages.banner(title)
        if args.skip_train:
            done = checkpoints[what]
            if done == final_checkpoint(run_dir, run_cfg.train.steps):
                stages.skip(f"finished: {done}")
            else:
                stages.skip(f"--skip-train: using the unfinished run's newest checkpoint {done}")
            continue
        done = final_checkpoint(run_dir, run_cfg.train.steps)
        if done is not None:
            _check_trained_on(run_dir, answers, what)
            stages.skip(f"finished: {done}")
        else:
            if answers is not None:  # before it starts: a resumed training must not switch files
                stamp_answers(run_dir, answers, what)
            run_stage(f"train {what}", ["train", recipe, *overrides])
            done = final_checkpoint(run_dir, run_cfg.train.steps)
            if done is None:
                raise DemoError(
                    f"training {what} ended without its final checkpoint in {run_dir}/checkpoints; "
                    "the training output above says why (e.g. train.max_bad_steps)"
                )
            stages.done(since)
        checkpoints[what] = done

    # 4. export
    since = stages.banner(f"export the DSpark draft to {paths.export_dir}")
    # --recipe: the DSpark training's recipe as resolved now, its overrides included (the recipe
    # file alone would show the model card a random Markov start where the bigram one trained),
    # with the eval and export sections as they are now (the run's config.yaml keeps older ones)
    export_recipe = paths.run_dir / EXPORT_RECIPE
    write_atomic(export_recipe, cfg.to_yaml())
    export_args = [
        "export", str(paths.run_dir), "--recipe", str(export_recipe), "--out", str(paths.export_dir),
        "--arch", cfg.export.arch,
        "--max-shard-size-mb", str(cfg.export.max_shard_size_mb),
        *(["--with-embeddings"] if cfg.export.with_embeddings else []),
    ]  # fmt: skip
    stamp = paths.run_dir / EXPORT_STAMP
    if export_is_current(paths, export_args, checkpoints["DSpark"]):
        stages.skip(f"{paths.export_dir} is this export of {checkpoints['DSpark']}")
    else:
        stamp.unlink(missing_ok=True)  # the stamp names the folder's command: none while it changes
        run_stage("export", export_args, indent=True)
        write_atomic(stamp, json.dumps({"command": export_args, "files": export_files(paths.export_dir)}))
        stages.done(since)

    # 5. evaluation: DSpark export + baselines, and DFlash from its checkpoint, same prompts
    eval_args, dflash_args = evaluation_commands(recipe, paths, workloads=workloads,
                                                 num_prompts=args.num_prompts,
                                                 max_new_tokens=args.max_new_tokens)  # fmt: skip
    parallel = evaluations_side_by_side()
    since = stages.banner(
        f"evaluate on {', '.join(workloads)}: DSpark vs no draft and n-gram, and the DFlash "
        f"ablation ({'side by side, one thread each' if parallel else 'one after the other'})"
    )
    # what draftforge eval takes from the recipe's eval section and uses here: an edit there
    # means another evaluation (the seed only where something is drawn: greedy DFlash
    # without the estimate draws nothing; verification and baselines are on the command line)
    from_recipe = {"seed": cfg.eval.seed}
    jobs = {}
    if not eval_is_current(paths.eval_dir, eval_args[1:], stamp, from_recipe):  # stamp: the export
        jobs["eval-dspark"] = eval_args
    if not eval_is_current(paths.dflash_eval_dir, dflash_args[1:], checkpoints["DFlash"] / "COMPLETE"):
        jobs["eval-dflash"] = dflash_args
    if jobs:
        run_side_by_side(jobs, paths.log_dir, parallel=parallel and len(jobs) > 1)
        stages.done(since)
    else:
        stages.skip(f"{paths.eval_dir} and {paths.dflash_eval_dir} hold this evaluation already")

    # 6. the model card gets the measured table; the demo's table
    since = stages.banner("the table (and the export's model card with the measured acceptance)")
    if not model_card_is_current(paths):
        run_stage("export (model card)", [*export_args, "--eval-report", str(paths.eval_dir / "report.md")],
                  indent=True)
    dspark_report = json.loads((paths.eval_dir / "report.json").read_text())
    dflash_report = json.loads((paths.dflash_eval_dir / "report.json").read_text())
    rows = table_rows(dspark_report, dflash_report)
    table = markdown_table(rows) + "\n\n" + lead_table(
        (paths.eval_dir / "report.json", dspark_report),
        (paths.dflash_eval_dir / "report.json", dflash_report),
    )
    text = demo_markdown(
        table, command=command, cfg=cfg, paths=paths, num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens, block_size=cfg.draft.block_size,
        trained={what: checkpoint_step(path) for what, path in checkpoints.items()},
        stopped={what: "data_exhausted" for what, run_dir, _, _ in trainings
                 if data_ran_out(run_dir) == checkpoints[what]},
        skip_train=args.skip_train, devices=recorded_devices(dspark_report, dflash_report),
        prompts={name: entry["num_prompts"] for name, entry in dspark_report["workloads"].items()},
    )  # fmt: skip
    write_atomic(paths.table, text)
    stages.done(since)
    print(f"\n{text}")
    print(
        f"demo: table written to {paths.table}; {stages.elapsed()}"
    )
    macro = rows[-1]
    print(
        f"export_dir={paths.export_dir} al_dspark={macro['dspark']:.3f} "
        f"al_dflash={macro['dflash']:.3f} al_ngram={macro['ngram']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
