"""Base class for every recipe section: strict types, unknown keys refused."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A strict config section.

    ``extra="forbid"`` turns a misspelt key into an error, ``strict=True``
    refuses silent coercions (``"8"`` for an int, ``1`` for a bool), and
    ``validate_assignment`` re-checks values that the loader derives later.
    """

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)
