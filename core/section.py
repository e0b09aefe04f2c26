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

    def __eq__(self, other: object) -> bool:
        """The same settings: the fields alone, not private state (where a recipe's keys were
        read from, whether a dtype was written ``auto``), which pydantic's equality compares."""
        if type(other) is not type(self):
            return NotImplemented
        return self.__dict__ == other.__dict__
