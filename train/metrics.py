"""What a run leaves behind: run-dir records, per-step metrics (JSONL, wandb, TensorBoard),
a progress bar and the final summary. Only trainer rank 0 creates these objects.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from draftforge.files import write_atomic

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def git_revision() -> str | None:
    """The draftforge source tree's commit (with ``-dirty`` when it has changes), or None."""
    source = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=source, capture_output=True,
                             text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=source,
                               capture_output=True, text=True, timeout=10)
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def package_versions(names=("torch", "transformers", "draftforge", "deepspeed", "safetensors")) -> dict:
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def write_run_records(run_dir: Path, *, recipe_yaml: str | None, details: dict) -> None:
    """config.yaml (the resolved recipe) and run.json (command line, git revision, versions)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if recipe_yaml is not None:
        write_atomic(run_dir / "config.yaml", recipe_yaml)
    record = {
        "command": [sys.executable, *sys.argv],
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_revision": git_revision(),
        "versions": package_versions(),
        "python": sys.version.split()[0],
        **details,
    }
    write_atomic(run_dir / "run.json", json.dumps(record, indent=1, sort_keys=True))


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
            self._wandb = _start_wandb(run_dir, train=train, recipe_yaml=recipe_yaml)
        if train.tensorboard:
            self._tensorboard = _start_tensorboard(run_dir, resume_step=resume_step)

    def _truncate_after(self, step: int) -> None:
        """Drop records of steps a resumed run will redo (written after its checkpoint)."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
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
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and v is not None}
        if self._wandb is not None:
            self._wandb.log(scalars, step=record["step"])
        if self._tensorboard is not None:
            for key, value in scalars.items():
                if key != "step":
                    self._tensorboard.add_scalar(f"train/{key}", value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _start_wandb(run_dir: Path, *, train, recipe_yaml: str | None):
    try:
        import wandb
    except ImportError as exc:
        raise RuntimeError(
            "train.wandb is true but wandb is not installed: .venv/bin/pip install 'wandb>=0.20' "
            "(or pip install 'draftforge[wandb]'), or set train.wandb=false"
        ) from exc
    config = None
    if recipe_yaml is not None:
        import yaml

        config = yaml.safe_load(recipe_yaml)
    return wandb.init(dir=str(run_dir), mode=train.wandb_mode, config=config,
                      name=run_dir.name, reinit="finish_previous")


def _start_tensorboard(run_dir: Path, *, resume_step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise RuntimeError(
            "train.tensorboard is true but tensorboard is not installed: "
            ".venv/bin/pip install 'tensorboard>=2.16', or set train.tensorboard=false"
        ) from exc
    # A resumed run redoes the steps after its checkpoint: purge_step drops the events
    # of the steps the interrupted run wrote past it, as the JSONL log drops its records.
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"),
                         purge_step=resume_step + 1 if resume_step else None)


class Progress:
    """A tqdm bar over optimizer steps: loss, tau, tokens/s; tqdm adds the ETA."""

    def __init__(self, *, total: int, initial: int, enabled: bool = True) -> None:
        from tqdm.auto import tqdm

        # Redraw less often into a log file than on a terminal.
        self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                        disable=not enabled, file=sys.stderr,
                        mininterval=0.1 if sys.stderr.isatty() else 5.0)
        self.started = time.perf_counter()

    def update(self, *, loss: float, tau: float, tokens_s: float) -> None:
        self.bar.set_postfix(loss=f"{loss:.4f}", tau=f"{tau:.3f}", tok_s=f"{tokens_s:.0f}", refresh=False)
        self.bar.update(1)

    def write(self, text: str) -> None:
        self.bar.write(text)

    def close(self) -> None:
        self.bar.close()


def format_summary(summary: dict) -> str:
    slots = " ".join(f"{a:.3f}" if a is not None else "nan" for a in summary.get("slot_acceptance", []))
    return (
        f"training summary: step {summary['step']}/{summary['total_steps']} "
        f"({summary['steps_this_run']} this run, {summary['skipped_steps']} skipped), "
        f"stop: {summary['stopped_reason']}\n"
        f"  loss {summary['loss']:.4f}  tau {summary['tau']:.3f} (mean of the last logged steps)  "
        f"per-slot acceptance [{slots}]\n"
        f"  {summary['tokens']} tokens in {summary['elapsed_s']:.1f} s ({summary['tokens_s']:.0f} tokens/s); "
        f"waiting for data {summary['wait_s']:.1f} s, computing {summary['compute_s']:.1f} s\n"
        f"  checkpoint: {summary['checkpoint']}"
    )


def write_summary(run_dir: Path, summary: dict) -> None:
    write_atomic(run_dir / SUMMARY_FILE, json.dumps({k: _finite(v) for k, v in summary.items()},
                                                     indent=1, sort_keys=True))
