"""Running the demo's stages: each a ``draftforge`` subcommand in its own process (the two
evaluations side by side where that helps), with numbered banners and elapsed times."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from draftforge.cores import usable_cores
from draftforge.signals import interrupts_held
from draftforge.splitserve.supervisor import terminal_sent_it_to_the_group


class DemoError(RuntimeError):
    """A stage failed or the outputs on disk belong to another run; the message says what to do.

    ``exit_status`` is the demo's: 2 when the input is at fault (outputs of another run or
    recipe, an option that cannot apply, a stage that itself refused its input with 2), as for
    every draftforge command; 1 for a failure."""

    def __init__(self, message: str, *, exit_status: int = 1):
        super().__init__(message)
        self.exit_status = exit_status


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
              indent: bool = False) -> list[str]:
    """Run ``draftforge ARGS`` with its output on the terminal; a failure raises DemoError.
    ``indent``: its standard output indented under the command line, as the stage's own (the
    export's ``export_dir=`` line must not read as the demo's last line to a script), and
    returned, its lines without their line ends (else nothing is returned: an empty list)."""
    command = draftforge_command(*args)
    print(f"    $ draftforge {shlex.join(args)}", flush=True)
    if indent:  # unbuffered: its lines keep their order with its messages on the terminal
        env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    proc: subprocess.Popen | None = None
    lines: list[str] = []
    try:
        with interrupts_held():  # one landing inside Popen would leave the stage running
            proc = subprocess.Popen(command, env=env, **(
                {"stdout": subprocess.PIPE, "text": True, "bufsize": 1, "errors": "replace"}
                if indent else {}))
        for line in proc.stdout if indent else ():
            lines.append(line.rstrip("\r\n"))
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
    return lines


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
            # A log that cannot be written (a full disk) is given up, said, and the output goes
            # on being read (a job whose pipe nobody reads blocks) and shown whole.
            in_report = False
            path = log_dir / f"{label}.log"
            try:
                # line-buffered: a full disk fails the write of the line concerned, which is then
                # shown, not a later flush of lines hidden from the terminal
                log = open(path, "w", buffering=1)  # noqa: SIM115 - closed below, or given up on an error
            except OSError as err:
                log = _log_lost(label, path, err, lock)
            for line in proc.stdout:
                if log is not None:
                    try:
                        log.write(line)
                    except OSError as err:
                        log = _log_lost(label, path, err, lock, log)
                in_report = (
                    in_report or line.startswith("Command: `")
                ) and not line.startswith("eval: report in")
                if not in_report or log is None:
                    with lock:
                        print(f"    [{label}] {line.rstrip()}", flush=True)
            if log is not None:
                try:
                    log.close()
                except OSError as err:
                    _log_lost(label, path, err, lock)

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


def _log_lost(label: str, path: Path, err: OSError, lock: threading.Lock, log=None) -> None:
    """Say that ``path`` could not be written (its output is shown on the terminal from here
    on); close ``log`` quietly. Returns None, the log given up."""
    if log is not None:
        with contextlib.suppress(OSError):
            log.close()
    with lock:
        print(f"    [{label}] warning: cannot write its log {path} ({err.strerror or err}); "
              "its output goes on here in full", flush=True)


def _finish(label: str, proc: subprocess.Popen, thread: threading.Thread, failures: list) -> None:
    status = proc.wait()
    thread.join()
    if status != 0:
        failures.append((label, status))


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def evaluations_side_by_side(threads: int = 1) -> bool:
    """Whether the two evaluations run at once: where the cores hold both at ``threads`` each
    (the recipe's ``target.num_threads``, which ``draftforge eval`` sets), but not where a GPU
    is visible (``draftforge eval --device auto`` takes it, and both would share it)."""
    return usable_cores() >= 2 * max(1, threads) and not _cuda_visible()
