"""Signal handlers whose exception is not lost in a finalizer.

A handler that raises (SystemExit, KeyboardInterrupt, a stop of our own) runs at the next
bytecode of the main thread, wherever it is. If that is a ``__del__`` the garbage collector is
running, Python does not raise the exception at all: it prints "Exception ignored ..." with a
traceback and goes on, and the process does not stop. :func:`outside_finalizers` wraps such a
handler: inside a finalizer it asks again 10 ms later (SIGALRM), once the finalizer has
returned, by raising the signal again, so that whatever handles it then (the same handler, or
the one that replaced it) does. A second signal handled meanwhile answers the deferred one too
(a handler that stops the process runs once, not again in the middle of its own cleanup), and
SIGALRM's own handler is put back.

:func:`interrupts_held` puts Ctrl-C and SIGTERM off while a child process starts, so that the
caller always has the child in hand to stop when they are handled.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any

Handler = Callable[[int, Any], None]


def outside_finalizers(handler: Handler) -> Handler:
    """``handler``, deferred while a ``__del__`` is on the stack of the interrupted frame."""

    deferred: dict[str, Any] = {}  # "signum" (the signal put off), "alarm" (SIGALRM's handler)

    def ask_again(_alarm: int, _frame: Any) -> None:
        signal.signal(signal.SIGALRM, deferred.pop("alarm", signal.SIG_DFL))
        signum = deferred.pop("signum", None)
        if signum is not None:  # not answered meanwhile: whoever handles it now does
            signal.raise_signal(signum)

    def guarded(signum: int, frame: Any) -> None:
        if _in_finalizer(frame):
            if "alarm" not in deferred:
                previous = signal.signal(signal.SIGALRM, ask_again)
                deferred["alarm"] = signal.SIG_DFL if previous is None else previous
            deferred["signum"] = signum
            signal.setitimer(signal.ITIMER_REAL, 0.01)
            return
        deferred.pop("signum", None)  # this call answers one put off before it
        handler(signum, frame)

    return guarded


def _in_finalizer(frame: Any) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM put off until the block ends, then handled as they would have been.

    For starting a child process that only the caller can stop (one in a session of its own):
    an interrupt landing inside ``subprocess.Popen``, after the fork but before it returns,
    raises with the child running and no ``Popen`` to stop it by. Hold interrupts around the
    start, inside the ``try`` whose handler stops the child::

        proc = None
        try:
            with interrupts_held():
                proc = subprocess.Popen(..., start_new_session=True)
            proc.wait()
        except BaseException:
            if proc is not None:
                stop(proc)
            raise

    Outside the main thread (where no handler can be set) it holds nothing."""
    held: list[int] = []
    previous: dict[int, Any] = {}
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, lambda got, _frame: held.append(got))
    except ValueError:  # not the main thread
        pass
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        for signum in dict.fromkeys(held):  # each signal once, in the order it came
            signal.raise_signal(signum)
