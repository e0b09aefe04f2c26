"""The per-slot acceptance plot written at the end of a run (matplotlib, Agg backend)."""

from __future__ import annotations

import io
import math
from pathlib import Path

from draftforge.files import write_atomic


def running_product(values: list[float]) -> list[float]:
    """The running product; from a slot without data (not a number) on, not a number."""
    out, running = [], 1.0
    for value in values:
        running *= value
        out.append(running)
    return out


def _measured(values) -> list[float]:
    """Slot means as floats, a slot without data (None or not a number) as not a number:
    drawn as no bar, where 0 would show an acceptance of zero."""
    return [math.nan if v is None or v != v else float(v) for v in values]


def acceptance_title(slot_means: list[float], tau: float | None) -> str:
    """The plot's title: the run's tau when known (a summary whose last steps supervised
    nothing has a not-a-number tau, which is no figure to show), and what the drawn line sums to."""
    measured = f"tau = {tau:.3f}, " if tau is not None and math.isfinite(tau) else ""
    line = [v for v in running_product(slot_means) if math.isfinite(v)]
    return f"per-slot acceptance ({measured}1 + sum of the line = {1 + sum(line):.3f})"


def plot_slot_acceptance(
    path: Path, *, final: list[float], first: list[float] | None = None, tau: float | None = None,
    title: str = "",
) -> Path:
    """Bar chart of the mean c*_k per block slot (end of training, and the start when given).

    Also draws the running product of those means as a line. It is not the mean over
    blocks of each block's own product (which the training metric tau sums: a block's
    slots are not independent), so the title shows ``tau``, the run's own figure, when
    given, and says the line's sum is only an approximation of it.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    slots = list(range(len(final)))
    clean = _measured(final)
    reach = running_product(clean)
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    width = 0.4 if first else 0.8
    if first:
        start = _measured(first)
        ax.bar([s - width / 2 for s in slots], start, width=width, label="first step", color="#bbbbbb")
        ax.bar([s + width / 2 for s in slots], clean, width=width, label="last log interval (mean)",
               color="#3a6ea5")
    else:
        ax.bar(slots, clean, width=width, label="mean c*_k", color="#3a6ea5")
    ax.plot(slots, reach, "o-", color="#d2691e", label="product of the means up to k")
    ax.set_xlabel("block slot k")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1)
    ax.set_xticks(slots)
    ax.set_title(title or acceptance_title(clean, tau))
    # below the axes, where it covers no bar (acceptance near 1 reaches the top)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, fontsize="small", frameon=False)
    fig.tight_layout()
    image = io.BytesIO()  # rendered in memory: a failed write leaves no temporary beside path
    try:
        fig.savefig(image, format="png", bbox_inches="tight")
    finally:
        plt.close(fig)
    path = Path(path)
    write_atomic(path, image.getvalue())
    return path
