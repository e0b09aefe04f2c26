"""Signal handlers whose exception is not lost in a finalizer.

A handler that raises (SystemExit, KeyboardInterrupt, a stop of our own) runs at the next
bytecode of the main thread, wherever it is. If that is a ``__del__`` the garbage collector is
running, Python does not raise the exception at all: it prints "Exception ignored ..." with a
traceback and goes on, and the process does not stop. :func:`outside_finalizers` wraps such a
handler: inside a finalizer it asks again 10 ms later (SIGALRM), once the finalizer has
returned.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

Handler = Callable[[int, Any], None]


def outside_finalizers(handler: Handler) -> Handler:
    """``handler``, deferred while a ``__del__`` is on the stack of the interrupted frame."""

    def guarded(signum: int, frame: Any) -> None:
        if _in_finalizer(frame):
            signal.signal(signal.SIGALRM, lambda _alarm, later: guarded(signum, later))
            signal.setitimer(signal.ITIMER_REAL, 0.01)
            return
        handler(signum, frame)

    return guarded


def _in_finalizer(frame: Any) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False
