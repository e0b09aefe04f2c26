"""Every rank of a job must run the same split and draft: checked once the ranks have met.

Each rank loads the recipe itself (on several nodes, each node from its own copy, with the
overrides its own command line gives), so two nodes given different files or overrides would
build different process groups or different drafts, and fail later with a misleading message
(a peer that "sent nothing", a collective that hangs). The ``split`` and ``draft`` sections, as
each rank resolved them, are gathered on the ack group right after the world is joined and
compared with rank 0's; any difference is refused on every rank alike, naming the keys and
the ranks. The other sections may differ legitimately between machines (a data path on
another mount, a ``dtype: auto`` resolved on other hardware) and are not compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from draftforge.errors import InputError

COMPARED = ("split", "draft")
SHOWN = 6  # differing keys named in the message at most


def resolved_sections(cfg) -> dict[str, Any]:
    """What a rank contributes: its resolved ``split`` and ``draft`` sections, as plain values."""
    return {name: getattr(cfg, name).model_dump(mode="json") for name in COMPARED}


def _differences(ours: dict[str, Any], theirs: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two resolved sections, with both values."""
    found = []
    for key in sorted(set(ours) | set(theirs)):
        a, b = ours.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            found.append(f"{prefix}{key} {b!r} (rank 0: {a!r})")
    return found


def recipe_differences(gathered: Sequence[dict[str, Any]], per_node: int | None = None) -> str | None:
    """One message naming every rank whose sections differ from rank 0's, and how (at most
    :data:`SHOWN` keys each); None when all agree. ``per_node`` (ranks per node, on several
    nodes) adds each rank's node to the message."""
    lines = []
    for rank, theirs in enumerate(gathered[1:], start=1):
        keys = _differences(gathered[0], theirs)
        if keys:
            where = f"rank {rank}" + (f" (node {rank // per_node})" if per_node else "")
            more = f", and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
            lines.append(f"{where}: {'; '.join(keys[:SHOWN])}{more}")
    if not lines:
        return None
    node0 = " (node 0)" if per_node else ""
    return (f"the ranks do not run the same recipe: the split and draft sections must be the same "
            f"on every rank, and these differ from rank 0's{node0}: " + " | ".join(lines) +
            ". Start every node with the same recipe file and the same key=value overrides "
            "(a recipe edited while the ranks start is read differently too)")


def check_same_recipe(cfg, world: int, group) -> None:
    """Gather every rank's :func:`resolved_sections` on ``group`` (every rank of the world) and
    raise :class:`~draftforge.errors.InputError` on each rank alike where they differ."""
    import torch.distributed as dist

    if world == 1:
        return
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, resolved_sections(cfg), group=group)
    per_node = world // cfg.split.num_nodes if cfg.split.num_nodes > 1 else None
    problem = recipe_differences(gathered, per_node)
    if problem is not None:
        raise InputError(problem)
