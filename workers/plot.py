"""The demo's plot: calls per second at the mock API against its limit (matplotlib, Agg).

Each bar is one second of arrivals, counted from the first call: allowed calls stacked under
refused ones (429), and a line at the API's rate. A fleet shaped right fills the seconds up
to the line and never past it; the last bar is usually a partial second.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def per_second(arrivals: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """Allowed and refused calls in each whole second since the first arrival."""
    if not arrivals:
        return [], []
    first = arrivals[0]["at_s"]
    seconds = math.floor(arrivals[-1]["at_s"] - first) + 1
    allowed, refused = [0] * seconds, [0] * seconds
    for arrival in arrivals:
        second = math.floor(arrival["at_s"] - first)
        (allowed if arrival["allowed"] else refused)[second] += 1
    return allowed, refused


def plot_calls(arrivals: list[dict[str, Any]], rate: float, burst: float, path: Path) -> Path:
    """Write the PNG of ``arrivals`` (the API's ``GET /arrivals``) to ``path``; returns it."""
    import matplotlib  # noqa: PLC0415 (slow import, only when a plot is asked for)

    matplotlib.use("Agg")  # no display: a file, on any machine or container
    import matplotlib.pyplot as plt  # noqa: PLC0415

    allowed, refused = per_second(arrivals)
    seconds = list(range(len(allowed)))
    fig, ax = plt.subplots(figsize=(10, 4), dpi=100)
    bars = {"width": 1.0, "align": "edge", "edgecolor": "white", "linewidth": 0.4}
    ax.bar(seconds, allowed, color="#4c8bd6", label="allowed (200)", **bars)
    ax.bar(seconds, refused, bottom=allowed, color="#d62728", label="refused (429)", **bars)
    ax.axhline(rate, color="black", linestyle="--", linewidth=1.2,
               label=f"API limit {rate:g}/s (burst {burst:g})")  # fmt: skip
    ax.set_xlim(0, max(len(seconds), 1))
    ax.set_ylim(0, max([rate, *(a + r for a, r in zip(allowed, refused, strict=True))]) * 1.25)
    ax.set_xlabel("seconds since the first call")
    ax.set_ylabel("calls per second at the API")
    ax.set_title(
        f"{len(arrivals)} calls, {sum(refused)} refused: the fleet against the API's limit"
    )
    ax.legend(loc="upper right", ncol=3, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
