"""Answer regeneration batches in several processes, each with its own copy of the target.

On a CPU a small target decodes a batch of 16 with matrices of 16 rows, which one
thread keeps nearly as busy as two: SmolLM2-135M-Instruct in float32 answered two
batches 1.3x faster as two one-thread processes than as one two-thread process
(PERFORMANCE.md). ``WorkerPool`` starts ``workers`` processes (spawned, so no
state is shared with the parent); each builds its target once, and the parent hands
it the next batch over its own pipe whenever it has finished one. Batches come back
in the order they finish; the caller writes each one as it arrives, so an interrupted
run keeps every finished batch, as with one process. The workers never outlive the parent:
it stops them when it stops (an error, Ctrl-C, SIGTERM), and the kernel sends them
SIGTERM when it dies without a chance to (SIGKILL, out of memory).

A batch's answers depend only on the batch (its seed comes from its ids), not on
which process answered it or when, so the file is the same for any number of
workers with the same threads each. Across thread counts it is the same only where
the target's arithmetic does not depend on them: true of the transformers backend in
float32 on the machines measured (a test compares one two-thread process with two
one-thread workers on SmolLM2), not in native bfloat16 (on an avx512_bf16 CPU a
quarter of the rows differed between one and two threads per target)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from draftforge.data.regenerate import RegenerationError
from draftforge.errors import InputError
from draftforge.signals import outside_finalizers
from draftforge.splitserve.supervisor import die_with

if TYPE_CHECKING:
    from draftforge.data.formats import Conversation
    from draftforge.splitserve.config import GenerationConfig

# (batch index, the prompts of that batch still to answer)
Pending = tuple[int, list["Conversation"]]


class WorkerError(RegenerationError):
    """A worker could not build its target or failed on a batch; says which and why."""


@outside_finalizers  # a SystemExit raised in a __del__ would be printed and lost
def _exit_cleanly(signum: int, frame: object) -> None:
    """SIGTERM (the parent stopping us) as SystemExit, so that exit handlers run: the
    semaphores our libraries made (tqdm's lock) are released instead of reported leaked."""
    raise SystemExit(128 + signum)


class _ParentGone(Exception):
    """The parent closed our pipe or died: nobody to answer or to tell."""


def _send(conn: Connection, message: tuple) -> None:
    try:
        conn.send(message)
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise _ParentGone from exc


def _receive(conn: Connection) -> Any:
    try:
        return conn.recv()
    except (EOFError, ConnectionResetError) as exc:
        raise _ParentGone from exc


def _work(build: Callable[[], Any], settings: GenerationConfig, conn: Connection, quiet: bool,
          parent_pid: int) -> None:
    """A worker: build the target, then answer each batch the parent sends until it sends None."""
    from draftforge.data.regenerate import answer_batch, quiet_loading

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops us
    signal.signal(signal.SIGTERM, _exit_cleanly)
    # The parent killed (SIGKILL, out of memory) gets no chance to stop us: the kernel's SIGTERM
    # does, instead of a worker answering batches nobody will read
    die_with_parent = die_with(parent_pid)
    if die_with_parent is not None:
        die_with_parent()
    batch = None  # None until the target is built and a batch taken
    try:
        if quiet:
            quiet_loading()
        engine = build()
        _send(conn, ("ready", engine.name))
        while (task := _receive(conn)) is not None:
            batch, prompts = task
            _send(conn, ("done", batch, *answer_batch(prompts, engine, settings)))
    except SystemExit:
        raise
    except _ParentGone:
        return  # it stops the run itself (or is dead): exit without a traceback
    except InputError as exc:  # a prompt the chat template refuses: its message, as one process says it
        try:
            _send(conn, ("refused", batch, str(exc)))
        except _ParentGone:
            pass
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        try:
            _send(conn, ("error", batch, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        except _ParentGone:
            pass
    finally:
        # Done (finished, refused, failed): this process only exits now, and the parent may
        # still SIGTERM it (it stops every worker once one fails). A SystemExit raised then in
        # the interpreter's shutdown would print "Exception ignored ... Traceback" under the
        # run's own message: from here SIGTERM changes nothing.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _died(i: int, process: multiprocessing.process.BaseProcess, remaining: int) -> WorkerError:
    """Worker ``i`` is gone without a word (its pipe closed): say so, with its exit status."""
    process.join(timeout=10)
    return WorkerError(
        f"regeneration worker {i} exited with status {process.exitcode} without a message "
        f"(killed, or out of memory?); {remaining} batches unanswered. Rerun to continue, or "
        "use --workers 1")


class WorkerPool:
    """``workers`` processes, each answering batches with the engine ``build()`` returns.

    ``build`` must be picklable (a module-level function, or a ``functools.partial`` of
    one) and is called once in each worker. ``name`` is the engine's name, written into
    every row; a worker whose engine has another name is an error. Each worker has a
    pipe of its own to the parent, which hands it the next batch when it is free.
    ``quiet``: no weight-loading progress bars from the workers (``--no-progress``).
    """

    def __init__(self, build: Callable[[], Any], workers: int, name: str, *, quiet: bool = False) -> None:
        if workers < 2:
            raise ValueError(f"a WorkerPool needs at least 2 workers, got {workers}")
        self.build, self.workers, self.name, self.quiet = build, workers, name, quiet

    def answer_batches(self, pending: Sequence[Pending], settings: GenerationConfig
                       ) -> Iterator[tuple[int, list[list[dict[str, str]]], list[list[int]],
                                           list[list[list[int] | None]]]]:
        """Yield ``(batch index, conversations, unfinished turns, generated ids)`` (``regenerate.
        answer_batch``'s) as the batches finish."""
        if not pending:
            return
        context = multiprocessing.get_context("spawn")
        queue = list(reversed(pending))  # pop() hands out the batches in order
        remaining = len(queue)
        conns, processes, index_of = [], [], {}
        try:
            for i in range(min(self.workers, len(queue))):
                parent_end, child_end = context.Pipe()
                process = context.Process(target=_work, name=f"draftforge-answer-{i}", daemon=True,
                                          args=(self.build, settings, child_end, self.quiet, os.getpid()))
                process.start()
                child_end.close()
                conns.append(parent_end)
                processes.append(process)
            index_of = {conn: i for i, conn in enumerate(conns)}
            while remaining:
                for conn in wait(list(index_of)):
                    i = index_of[conn]
                    try:
                        message = conn.recv()
                    except EOFError:
                        raise _died(i, processes[i], remaining) from None
                    kind = message[0]
                    if kind == "refused":  # the input's fault, which the message names: no traceback
                        raise WorkerError(message[2])
                    if kind == "error":
                        _, batch, error, trace = message
                        where = "building its target" if batch is None else f"answering batch {batch}"
                        raise WorkerError(f"regeneration worker {i} failed while {where}: {error}\n"
                                          f"(the worker's traceback)\n{trace.rstrip()}")
                    if kind == "ready" and message[1] != self.name:
                        raise WorkerError(f"regeneration worker {i} built target {message[1]!r}, "
                                          f"expected {self.name!r}")
                    if kind == "done":
                        remaining -= 1
                        yield message[1], message[2], message[3], message[4]
                    if queue:
                        try:
                            conn.send(queue.pop())  # its next batch
                        except OSError:  # it died since its message (killed while idle: out of memory?)
                            raise _died(i, processes[i], remaining) from None
                    else:
                        try:
                            conn.send(None)  # its end: it exits, and its pipe is no longer watched
                        except OSError:
                            pass  # it has exited already, with nothing left to answer
                        del index_of[conn]
        finally:
            # Finished: tell the workers not told yet (one may still be building its target
            # when the others have answered everything) and let them exit by themselves.
            # Stopped early (an error, Ctrl-C): stop them now.
            for conn in index_of if not remaining else ():
                try:
                    conn.send(None)
                except OSError:
                    pass
            for process in processes:
                process.join(timeout=0 if remaining else 5)
                if process.is_alive():
                    process.terminate()
                    process.join(timeout=10)
                if process.is_alive():
                    process.kill()
                    process.join()
            for conn in conns:
                conn.close()
