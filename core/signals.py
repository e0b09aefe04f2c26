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
"""

from __future__ import annotations

import signal
from collections.abc import Callable
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
