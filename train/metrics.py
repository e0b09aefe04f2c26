"""What a run leaves behind: run-dir records, per-step metrics (JSONL, wandb, TensorBoard),
a progress bar and the final summary. Only trainer rank 0 creates these objects.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from draftforge.files import naming, write_atomic

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
PLOT_FILE = "slot_acceptance.png"  # the summary's per-slot acceptance, drawn
NO_PLOT = "no_plot"  # the summary's key for why PLOT_FILE could not be drawn
RUN_FILE = "run.json"
CONFIG_FILE = "config.yaml"
WANDB_ID_FILE = "wandb_id.txt"


def _names_draftforge(pyproject: Path) -> bool:
    """Whether ``pyproject`` is draftforge's own (its ``[project]`` name)."""
    try:
        text = pyproject.read_text()
    except (OSError, UnicodeDecodeError):
        return False
    try:
        import tomllib
    except ImportError:  # Python 3.10
        found = re.search(r"^\[project\][^\[]*?^name\s*=\s*[\"']draftforge[\"']", text, re.M | re.S)
        return found is not None
    try:
        return tomllib.loads(text).get("project", {}).get("name") == "draftforge"
    except tomllib.TOMLDecodeError:
        return False


def git_revision(source: Path | None = None) -> str | None:
    """The draftforge source tree's commit (with ``-dirty`` when it has changes, ``-unknown-state``
    when git cannot tell), or None.

    ``source`` (default: the one this module runs from) is the folder above the package's;
    only a git work tree whose top is that folder, holding draftforge's pyproject.toml, counts.
    An installed copy (site-packages) inside the user's own repository would otherwise report
    the user's commit as draftforge's."""
    source = (source or Path(__file__).resolve().parent.parent).resolve()
    if not _names_draftforge(source / "pyproject.toml"):
        return None
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=source, capture_output=True,
                             text=True, timeout=10)
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != source:
            return None
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=source, capture_output=True,
                             text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=source,
                               capture_output=True, text=True, timeout=10)
        if dirty.returncode != 0:  # a corrupt index: whether the tree has changes is not known
            return rev.stdout.strip() + "-unknown-state"
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def package_versions(names=("torch", "transformers", "draftforge", "deepspeed", "safetensors", "sglang",
                           "wandb", "tensorboard")) -> dict:
    """Each package's installed version, None where it is not installed (the optional ones:
    deepspeed, sglang, wandb, tensorboard)."""
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _read_segments(path: Path) -> list[dict]:
    """run.json's segments, oldest first; an unreadable run.json is kept aside, not lost."""
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        record = exc
    if not isinstance(record, dict):
        aside, n = path.with_name(path.name + ".unreadable"), 1
        while aside.exists():  # an earlier one set aside stays
            n += 1
            aside = path.with_name(f"{path.name}.unreadable.{n}")
        os.replace(path, aside)
        write_line(f"[trainer] warning: {path} is not a run record ({record!r:.80}); kept as {aside}, "
                   "a new one started")
        return []
    # a run.json written before segments existed is the record of the first one
    return record["segments"] if "segments" in record else [record]


def _launch_command() -> dict:
    """``launched_by``: the user's ``draftforge train`` (or ``bench split``) command line, which
    the launcher passes to its ranks; absent for a rank torchrun started by hand."""
    from draftforge.splitserve.launch import LAUNCH_COMMAND_ENV

    text = os.environ.get(LAUNCH_COMMAND_ENV)
    try:
        command = json.loads(text) if text else None
    except json.JSONDecodeError:
        command = None
    return {"launched_by": command} if isinstance(command, list) else {}


def write_run_records(run_dir: Path, *, recipe_yaml: str | None, details: dict) -> int:
    """Append this training segment (a first run, a resume or a rerun) to run.json: its
    command line and ``cwd``, the folder it ran in (the base of the command's relative paths),
    start time, git revision, versions, ``details`` and ``config``, the file holding its
    resolved recipe. Earlier segments stay as they were written. Returns the segment's number
    (from 1), for :func:`record_segment_summary`.

    config.yaml is the newest segment's recipe. An earlier one that differs is kept as
    ``config.<N>.yaml``, N the number (from 1) of the first segment that ran it (the next free
    number where that file exists: a run.json set aside restarts the count), and the segments
    that ran it say so."""
    run_dir.mkdir(parents=True, exist_ok=True)
    segments = _read_segments(run_dir / RUN_FILE)
    saved = run_dir / CONFIG_FILE
    if recipe_yaml is not None and saved.is_file() and saved.read_text() != recipe_yaml:
        ran = [n for n, s in enumerate(segments, 1) if s.get("config", CONFIG_FILE) == CONFIG_FILE]
        number = ran[0] if ran else len(segments)
        while (run_dir / f"config.{number}.yaml").exists():  # after a run.json set aside: not reused
            number += 1
        kept = f"config.{number}.yaml"
        write_atomic(run_dir / kept, saved.read_text())
        for n in ran:
            segments[n - 1]["config"] = kept
    segments.append({
        "command": [sys.executable, *sys.argv],
        "cwd": os.getcwd(),
        **_launch_command(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_revision": git_revision(),
        "versions": package_versions(),
        "python": sys.version.split()[0],
        **details,
        "config": CONFIG_FILE if recipe_yaml is not None else None,
    })
    # run.json first: a crash before config.yaml is rewritten leaves each earlier segment's
    # recipe where run.json says it is
    write_atomic(run_dir / RUN_FILE, json.dumps({"segments": segments}, indent=1, sort_keys=True))
    if recipe_yaml is not None:
        write_atomic(saved, recipe_yaml)
    return len(segments)


# what a summary must share with another to describe the same state of the run
SUMMARY_STATE = ("step", "total_steps", "stopped_reason")


def _recorded_segments(run_dir: Path) -> list:
    """run.json's segments as they stand; [] where it is missing or unreadable (left there:
    the next segment's :func:`write_run_records` sets it aside)."""
    try:
        record = json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return []
    segments = record.get("segments") if isinstance(record, dict) else None
    return segments if isinstance(segments, list) else []


def record_segment_summary(run_dir: Path, number: int, summary: dict) -> None:
    """Keep the summary segment ``number`` wrote (:func:`write_run_records`' number) in its
    run.json record: each segment's figures, among them those only its own clock had (its
    wall time, tokens/s). Nothing where run.json no longer holds the segment (set aside as
    unreadable since)."""
    segments = _recorded_segments(run_dir)
    if not 1 <= number <= len(segments) or not isinstance(segments[number - 1], dict):
        return
    segments[number - 1]["summary"] = {k: _finite(v) for k, v in summary.items()}
    write_atomic(run_dir / RUN_FILE, json.dumps({"segments": segments}, indent=1, sort_keys=True))


def recorded_summary(run_dir: Path, summary: dict) -> dict | None:
    """The summary a segment recorded in run.json (:func:`record_segment_summary`) of the same
    state of the run as ``summary`` (its step, train.steps and stop) and recording that its plot
    could not be drawn (``no_plot``), the newest such, or None: the summary.json the advice to
    try the plot again says to remove comes back whole, its wall time and tokens/s with it. A
    segment that started at step 0 began the run: none before it is looked at."""
    for segment in reversed(_recorded_segments(run_dir)):
        if not isinstance(segment, dict):
            continue
        kept = segment.get("summary")
        if (isinstance(kept, dict) and isinstance(kept.get(NO_PLOT), str)
                and all(kept.get(key) == summary[key] for key in SUMMARY_STATE)):
            return dict(kept)
        if segment.get("start_step") == 0:
            return None
    return None


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _unfinite(record: dict) -> dict:
    """A logged record as the trainer made it: the nulls ``_finite`` wrote are NaN again."""
    def back(value):
        if value is None:
            return float("nan")
        return [back(v) for v in value] if isinstance(value, list) else value

    return {k: back(v) if k in ("loss", "tau", "slot_acceptance") else v for k, v in record.items()}


class MetricsLog:
    """Per-step records: always JSONL; wandb and TensorBoard when the recipe enables them."""

    def __init__(self, run_dir: Path, *, train, recipe_yaml: str | None, resume_step: int = 0) -> None:
        self.path = run_dir / METRICS_FILE
        self.earlier: list[dict] = []  # the records a resumed run keeps, oldest first
        self._truncate_after(resume_step)
        self._file = self.path.open("a")
        self._wandb = self._tensorboard = None
        if train.wandb:
            self._wandb = _start_wandb(run_dir, train=train, recipe_yaml=recipe_yaml,
                                       resume_step=resume_step)
        if train.tensorboard:
            self._tensorboard = _start_tensorboard(run_dir, resume_step=resume_step)

    def _truncate_after(self, step: int) -> None:
        """Drop records of steps a resumed run will redo (written after its checkpoint)."""
        kept = []  # the file is written even when absent: sync() then needs no fsync of its folder
        for line in self.path.read_text().splitlines() if self.path.exists() else ():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("step", 0) <= step:
                kept.append(line)
                self.earlier.append(_unfinite(record))
        write_atomic(self.path, "".join(line + "\n" for line in kept))

    def log(self, record: dict) -> None:
        record = {k: _finite(v) for k, v in record.items()}
        with naming(self.path):
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float))}
        # the per-slot acceptance c*_k, a scalar a slot (a non-finite one, null above, left out)
        scalars |= {f"slot_acceptance/{k}": v for k, v in enumerate(record.get("slot_acceptance") or [])
                    if v is not None}
        if self._wandb is not None:
            self._wandb.log(scalars, step=record["step"])
        if self._tensorboard is not None:
            for key, value in scalars.items():
                if key != "step":
                    self._tensorboard.add_scalar(f"train/{key}", value, record["step"])

    def sync(self) -> None:
        """Make the records logged so far durable: the trainer calls this before each checkpoint,
        which is fsynced, so that a machine crash never leaves a checkpoint ahead of its records
        (a resume would redo none of the lost steps, leaving a gap in metrics.jsonl)."""
        with naming(self.path):
            os.fsync(self._file.fileno())

    def close(self) -> None:
        with naming(self.path):
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()


WANDB_MISSING = ("train.wandb is true but wandb is not installed: .venv/bin/pip install 'wandb>=0.20' "
                 "(or pip install 'draftforge[wandb]'), or set train.wandb=false")
TENSORBOARD_MISSING = ("train.tensorboard is true but tensorboard is not installed: "
                       ".venv/bin/pip install 'tensorboard>=2.16', or set train.tensorboard=false")


def missing_loggers(train) -> list[str]:
    """The install advice for each logger ``train`` turns on whose package is missing; the
    launcher checks this before any rank starts (the trainer finds it only at its first step)."""
    import importlib.util

    found = {name: importlib.util.find_spec(name) is not None for name in ("wandb", "tensorboard")}
    return ([WANDB_MISSING] if train.wandb and not found["wandb"] else []) + (
        [TENSORBOARD_MISSING] if train.tensorboard and not found["tensorboard"] else [])


def _start_wandb(run_dir: Path, *, train, recipe_yaml: str | None, resume_step: int):
    try:
        import wandb
    except ImportError as exc:
        raise RuntimeError(WANDB_MISSING) from exc
    config = None
    if recipe_yaml is not None:
        import yaml

        config = yaml.safe_load(recipe_yaml)
    # One wandb run per run directory: a resumed segment continues the run the first one
    # opened (its id in wandb_id.txt) rather than opening another of the same name. A run
    # that starts from step 0 (nothing to resume, or train.resume=never) is a new wandb run.
    id_file = run_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if resume_step and id_file.is_file() else ""
    if not run_id:
        run_id = "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(8))
        write_atomic(id_file, run_id + "\n")
    return wandb.init(dir=str(run_dir), mode=train.wandb_mode, config=config, name=run_dir.name,
                      id=run_id, resume="allow", reinit="finish_previous")


def _start_tensorboard(run_dir: Path, *, resume_step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise RuntimeError(TENSORBOARD_MISSING) from exc
    # A resumed run redoes the steps after its checkpoint: purge_step drops the events
    # of the steps the interrupted run wrote past it, as the JSONL log drops its records.
    # A run that starts from step 0 over an earlier run's events (one that crashed before
    # its first checkpoint) drops them all, as metrics.jsonl does: else TensorBoard draws
    # both runs' steps 1.. as one series.
    folder = run_dir / "tensorboard"
    earlier = folder.is_dir() and any(folder.glob("events.out.tfevents.*"))
    return SummaryWriter(log_dir=str(folder),
                         purge_step=resume_step + 1 if resume_step or earlier else None)


# the progress bar this process draws now, if any (say() writes around it)
_ACTIVE: list[Progress] = []
# On a terminal, a line from another process (a target rank) first clears the line it lands
# on: the trainer's bar, drawn without a newline, would otherwise run into it. The bar is
# drawn again at its next step.
CLEAR_LINE = "\r\x1b[K"


def write_line(text: str, file=None) -> None:
    """Write ``text`` and its newline to ``file`` (default stdout) in one write, flushed.

    The ranks of a job share the launcher's stdout and stderr; under PYTHONUNBUFFERED (set in
    many containers) ``print`` writes the text and its newline as two writes, and another
    rank's line could land between them: two ranks' lines joined on one line, the next line
    empty. One write of a line (under the pipe's 4 KiB) is never split by another's."""
    file = sys.stdout if file is None else file
    file.write(text + "\n")
    file.flush()


def say(line: str) -> None:
    """Write ``line`` to stderr on a line of its own: through this process's progress bar
    when one is drawn (tqdm clears it, writes, and draws it again), else after clearing the
    terminal's current line, where another process's bar may stand. The line and its newline
    go in one write (:func:`write_line`)."""
    if _ACTIVE:
        _ACTIVE[-1].bar.write(line + "\n", file=sys.stderr, end="")
        return
    write_line((CLEAR_LINE if sys.stderr.isatty() else "") + line, sys.stderr)


class _BarLines:
    """The bar's stream where stderr is no terminal (a log file, a pipe the ranks share): each
    drawing of the bar a line of its own, in one write. tqdm draws it as ``\\r`` and the bar
    without a newline, so another rank's line written then was joined to its end; its clearing
    (blanks) is dropped, and the messages written around the bar (:func:`say`) need none."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.encoding = getattr(stream, "encoding", None)  # tqdm's bar characters: unicode or ascii

    def write(self, text: str) -> int:
        drawn = text.replace("\r", "").strip()
        if drawn:
            write_line(drawn, self.stream)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


class Progress:
    """A tqdm bar over optimizer steps: loss, tau, tokens/s; tqdm adds the ETA."""

    def __init__(self, *, total: int, initial: int, enabled: bool = True) -> None:
        from tqdm.auto import tqdm

        # Redraw less often into a log file than on a terminal, a line each time.
        terminal = sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                        disable=not enabled, file=sys.stderr if terminal else _BarLines(sys.stderr),
                        mininterval=0.1 if terminal else 5.0)
        self.started, self.tokens, self.tokens_s = time.perf_counter(), 0, 0.0
        if enabled:
            _ACTIVE.append(self)

    def update(self, *, loss: float, tau: float, tokens: int, elapsed_s: float | None = None) -> None:
        """One step done: its loss and tau, and its ``tokens`` for tokens/s, which counts this
        run's tokens over its wall time so far (waits and checkpoints included), not the last
        step's rate; ``elapsed_s``, that wall time as the trainer's clock gives it (default: since
        the bar started), makes the last step's figure the summary's tokens_s."""
        self.tokens += tokens
        elapsed = time.perf_counter() - self.started if elapsed_s is None else elapsed_s
        self.tokens_s = self.tokens / max(elapsed, 1e-9)
        self.bar.set_postfix(loss=f"{loss:.4f}", tau=f"{tau:.3f}", tok_s=f"{self.tokens_s:.0f}", refresh=False)
        self.bar.update(1)

    def write(self, text: str) -> None:
        """``text`` on stdout on a line of its own, in one write with its newline (see
        :func:`write_line`); on a terminal the bar is cleared and drawn again around it."""
        self.bar.write(text + "\n", file=sys.stdout, end="")

    def close(self) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        self.bar.close()


def format_summary(summary: dict) -> str:
    slots = " ".join(f"{a:.3f}" if a is not None else "nan" for a in summary.get("slot_acceptance", []))
    return (
        f"training summary: step {summary['step']}/{summary['total_steps']} "
        f"({summary['steps_this_run']} this run, {summary['skipped_steps']} skipped), "
        f"stop: {summary['stopped_reason']}"
        + (f" ({summary['untrained_at_end']} samples taken for a last step that no trainer rank "
           "could fill were not trained: a step takes train.grad_accum micro-batches)"
           if summary.get("untrained_at_end") else "") + "\n"
        f"  loss {summary['loss']:.4f}  tau {summary['tau']:.3f} (mean of the last train.log_interval applied steps)  "
        f"per-slot acceptance [{slots}]\n"
        f"  {summary['tokens']} tokens"
        # the steps' tokens are every trainer rank's: the split accounting's trainer line is one rank's
        + (f" (all {summary['trainer_ranks']} trainer ranks)" if (summary.get("trainer_ranks") or 1) > 1 else "")
        + f" in {summary['elapsed_s']:.1f} s ({summary['tokens_s']:.0f} tokens/s); "
        f"waiting for data {summary['wait_s']:.1f} s, computing {summary['compute_s']:.1f} s"
        + (" (the first trainer rank's)" if (summary.get("trainer_ranks") or 1) > 1 else "")
        + (f" (rebuilt from {summary['rebuilt_from']}: every logged step's, their waits and computing "
           "only)" if summary.get("rebuilt_from") else "") + "\n"
        f"  checkpoint: {summary['checkpoint']}"
    )


def read_summary(run_dir: Path) -> dict:
    """The run's summary.json; empty where there is none, or it is unreadable or not an object."""
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return {}
    return summary if isinstance(summary, dict) else {}


def write_summary(run_dir: Path, summary: dict) -> None:
    write_atomic(run_dir / SUMMARY_FILE, json.dumps({k: _finite(v) for k, v in summary.items()},
                                                     indent=1, sort_keys=True))
