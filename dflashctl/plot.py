"""Loss and acceptance-length curves of a run: in the terminal (plotext) or as a PNG (matplotlib)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from .errors import DflashError, UsageError

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


def require_matplotlib() -> Any:
    """matplotlib.pyplot on the Agg backend, or UsageError naming the extra that installs it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        raise UsageError("--plot FILE.png needs matplotlib: pip install 'dflashctl[plot]'") from None
    return pyplot


def check_plot_path(path: Path) -> Path:
    """The file --plot will write (`.png` added to a bare name); UsageError when it cannot be written."""
    require_matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase

    if not path.suffix.strip("."):
        path = path.with_name(path.name.rstrip(".") + ".png")  # matplotlib's own default, named up front
    fmt = path.suffix[1:].lower()
    # pgf needs a TeX installation that matplotlib only looks for while writing.
    formats = sorted(set(FigureCanvasBase.get_supported_filetypes()) - {"pgf"})
    if fmt not in formats:
        raise UsageError(f"--plot {path}: matplotlib cannot write .{fmt} files (use one of: {', '.join(formats)})")
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"--plot {path}: no such directory {parent}")
    if path.is_dir():
        raise UsageError(f"--plot {path}: is a directory")
    if not os.access(path if path.exists() else parent, os.W_OK):
        raise UsageError(f"--plot {path}: {path if path.exists() else parent} is not writable")
    return path


def held_out(records: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of a metric from the evaluation records (held-out data) only."""
    return series([r for r in records if r.get("event") in ("eval", "final")], key)


def save_png(records: Sequence[dict[str, Any]], path: Path, run_id: str) -> None:
    """Write loss (training and held-out) and teacher-forced acceptance length to a PNG."""
    pyplot = require_matplotlib()
    panels = [
        ("loss", "loss", [("training", series(records, "loss")), ("held-out", held_out(records, "loss"))]),
        (
            "acceptance length",
            "tokens per block (teacher-forced)",
            [("held-out", held_out(records, "acceptance_length"))],
        ),
    ]
    panels = [(title, ylabel, [(n, c) for n, c in lines if c[0]]) for title, ylabel, lines in panels]
    panels = [p for p in panels if p[2]]
    if not panels:
        raise UsageError("no metrics to plot yet")
    fig, axes = pyplot.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (title, ylabel, lines) in zip(axes[0], panels):
        for name, (xs, ys) in lines:
            ax.plot(xs, ys, label=name, marker="o" if name == "held-out" else None, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"run {run_id}")
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:  # checked up front; this is a disk that filled or changed since
        raise DflashError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        pyplot.close(fig)
