"""Loss and acceptance-length curves of a run: in the terminal (plotext) or as a PNG (matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .errors import UsageError

CURVES = (("loss", "training loss"), ("acceptance_length", "acceptance length"))


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of one metric, skipping records that lack it. Loss comes from training
    records only: the trainer's eval records carry the held-out loss, a different curve."""
    xs, ys = [], []
    for r in records:
        if key == "loss" and r.get("event", "train") != "train":
            continue
        step, value = r.get("step"), r.get(key)
        if isinstance(step, (int, float)) and isinstance(value, (int, float)):
            xs.append(step)
            ys.append(value)
    return xs, ys


def terminal_plot(records: Sequence[dict[str, Any]], width: int = 100, height: int = 16) -> str | None:
    """The curves side by side as plain text, or None when there is nothing to draw."""
    import plotext

    present = [(key, title, *series(records, key)) for key, title in CURVES]
    present = [c for c in present if len(c[2]) >= 1]
    if not present:
        return None
    fig = plotext.figure
    fig.clear()  # plotext keeps one figure per process: start from a blank one
    fig.plot_size(width, height)
    fig.theme("colorless")
    if len(present) > 1:
        fig.subplots(1, len(present))
    for col, (_, title, xs, ys) in enumerate(present, start=1):
        sub = fig.subplot(1, col) if len(present) > 1 else fig
        sub.draw(sub.signal(xs, ys).lines())
        sub.title(title)
        sub.label("step")
    return fig.build().string(colorless=True)


def save_png(records: Sequence[dict[str, Any]], path: Path) -> None:
    """Write the curves to a PNG with matplotlib (an optional dependency)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        raise UsageError("--plot FILE.png needs matplotlib: pip install matplotlib") from None
    present = [(title, *series(records, key)) for key, title in CURVES]
    present = [c for c in present if c[1]]
    if not present:
        raise UsageError("no metrics to plot yet")
    fig, axes = pyplot.subplots(1, len(present), figsize=(6 * len(present), 4), squeeze=False)
    for ax, (title, xs, ys) in zip(axes[0], present):
        ax.plot(xs, ys)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    pyplot.close(fig)
