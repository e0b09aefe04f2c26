"""Base class for every recipe section: strict types, unknown keys refused."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A strict config section.

    ``extra="forbid"`` turns a misspelt key into an error, ``strict=True``
    refuses silent coercions (``"8"`` for an int, ``1`` for a bool), and
    ``validate_assignment`` re-checks values that the loader derives later, and
    ``allow_inf_nan=False`` refuses ``.inf`` and ``.nan`` (YAML spells both), which
    would pass bounds such as ``gt=0`` (``lr: .inf``) and train nothing useful.
    """

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, allow_inf_nan=False)
