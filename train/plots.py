"""The per-slot acceptance plot written at the end of a run (matplotlib, Agg backend)."""

from __future__ import annotations

import os
from pathlib import Path


def plot_slot_acceptance(
    path: Path, *, final: list[float], first: list[float] | None = None, title: str = ""
) -> Path:
    """Bar chart of the mean c*_k per block slot (end of training, and the start when given).

    Also prints the cumulative product (the probability that slot k is reached
    and accepted) as a line, which is what the expected acceptance length sums.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    slots = list(range(len(final)))
    clean = [0.0 if v is None or v != v else float(v) for v in final]
    reach, running = [], 1.0
    for value in clean:
        running *= value
        reach.append(running)
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    width = 0.4 if first else 0.8
    if first:
        start = [0.0 if v is None or v != v else float(v) for v in first]
        ax.bar([s - width / 2 for s in slots], start, width=width, label="first steps", color="#bbbbbb")
        ax.bar([s + width / 2 for s in slots], clean, width=width, label="last steps", color="#3a6ea5")
    else:
        ax.bar(slots, clean, width=width, label="mean c*_k", color="#3a6ea5")
    ax.plot(slots, reach, "o-", color="#d2691e", label="prod_{i<=k} c*_i")
    ax.set_xlabel("block slot k")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1)
    ax.set_xticks(slots)
    ax.set_title(title or f"per-slot acceptance (tau = {1 + sum(reach):.3f})")
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
    return path
