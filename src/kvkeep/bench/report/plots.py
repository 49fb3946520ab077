"""The pieces of the report's PNG plots: a figure to draw into, and bars by mode. Each
scenario module draws its own plots from its typed results (its `Command` names them)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def figure(path: Path, title: str, xlabel: str, ylabel: str, rows: int = 1) -> Iterator[Any]:
    """Matplotlib axes (one per row) drawn into ``path`` on leaving the block."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, 1, figsize=(7 if rows == 1 else 9, 3 * rows + 1), sharex=True)
    each = list(axes) if rows > 1 else [axes]
    each[0].set_title(title)
    each[-1].set_xlabel(xlabel)
    for ax in each:
        ax.grid(alpha=0.3)
        ax.set_ylabel(ylabel)
    yield axes
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bar_plot(
    path: Path,
    labels: list[str],
    series: dict[str, list[float]],
    ylabel: str,
    title: str,
    stacked: bool = False,
    xlabel: str = "",
    log: bool = False,
) -> list[Path]:
    """``series`` ({name: a value per label}) as grouped bars, or stacked ones."""
    with figure(path, title, xlabel, ylabel) as ax:
        bottom = [0.0] * len(labels)
        width = 0.8 if stacked else 0.8 / max(1, len(series))
        for i, (name, vals) in enumerate(series.items()):
            xs = [k if stacked else k + i * width for k in range(len(labels))]
            ax.bar(xs, vals, width, bottom=bottom if stacked else None, label=name)
            if stacked:
                bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        offset = 0 if stacked else 0.4 - width / 2
        ax.set_xticks([k + offset for k in range(len(labels))], labels)
        if log:
            ax.set_yscale("log")
        if len(series) > 1:
            ax.legend()
    return [path]
