"""The one exception type for unusable input that a user handed draftforge.

A corrupt checkpoint, a truncated data file, a draft that does not fit its
target: the message names the file (or option) and what to do, and the
``draftforge`` command prints it without a traceback and exits with status 2.
Module-specific errors (``DataFormatError``, ``ExportError``, ``CheckpointError``)
derive from it. :func:`last_lines` cuts a failed tool's output down to such a message.
"""

from __future__ import annotations


class InputError(ValueError):
    """A file or argument given to draftforge cannot be used; ``str()`` says which and why."""


def last_lines(text: str, lines: int = 6) -> str:
    """The last ``lines`` lines of a tool's output, blank ones left out, joined with `` | ``:
    a one-line reason."""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:] if line.strip())
