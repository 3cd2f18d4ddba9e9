"""Loss and acceptance-length curves of a run: in the terminal (plotext) or as a PNG (matplotlib)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from .errors import DflashError, UsageError

# Each panel: its title and the metric keys it draws, the first one present. The in-training
# speculative tau is the real figure (runs list's); the teacher-forced acceptance only a proxy.
CURVES = (
    ("training loss", ("loss",)),
    ("speculative tau", ("spec_tau_prompt_mean", "spec_tau")),
    ("teacher-forced (a proxy)", ("acceptance_length",)),
)


def series(records: Sequence[dict[str, Any]], key: str, held_out: bool = False) -> tuple[list[float], list[float]]:
    """(steps, values) of one metric, skipping records that lack it. Loss comes from training
    records only (unless held_out): the trainer's eval records carry the held-out loss, a
    different curve."""
    xs, ys = [], []
    for r in records:
        if key == "loss" and not held_out and r.get("event", "train") != "train":
            continue
        step, value = r.get("step"), r.get(key)
        if isinstance(step, (int, float)) and isinstance(value, (int, float)):
            xs.append(step)
            ys.append(value)
    return xs, ys


def terminal_plot(records: Sequence[dict[str, Any]], width: int = 100, height: int = 16) -> str | None:
    """The curves side by side as plain text, or None when there is nothing to draw."""
    import plotext

    present = [(title, *first_series(records, keys)) for title, keys in CURVES]
    present = [c for c in present if len(c[1]) >= 1]
    if not present:
        return None
    fig = plotext.figure
    fig.clear()  # plotext keeps one figure per process: start from a blank one
    fig.plot_size(width, height)
    fig.theme("colorless")
    if len(present) > 1:
        fig.subplots(1, len(present))
    for col, (title, xs, ys) in enumerate(present, start=1):
        sub = fig.subplot(1, col) if len(present) > 1 else fig
        sub.draw(sub.signal(xs, ys).lines())
        sub.title(title)
        sub.label("step")
    return fig.build().string(colorless=True)


def first_series(records: Sequence[dict[str, Any]], keys: Sequence[str]) -> tuple[list[float], list[float]]:
    """The series of the first of `keys` the records have (an older run logged only `spec_tau`)."""
    return next((xy for xy in (series(records, key) for key in keys) if xy[0]), ([], []))


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


def held_out_records(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluation records (held-out data)."""
    return [r for r in records if r.get("event") in ("eval", "final")]


def held_out(records: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of a metric from the evaluation records (held-out data) only."""
    return series(held_out_records(records), key, held_out=True)


def save_png(records: Sequence[dict[str, Any]], path: Path, run_id: str) -> None:
    """Write loss (training and held-out) and acceptance length (the in-training speculative tau
    and the teacher-forced proxy) to a PNG."""
    pyplot = require_matplotlib()
    tau = first_series(held_out_records(records), CURVES[1][1])
    panels = [
        ("loss", "loss", [("training", series(records, "loss")), ("held-out", held_out(records, "loss"))]),
        (
            "acceptance length",
            "tokens per verify step",
            [("speculative tau", tau), ("teacher-forced (a proxy)", held_out(records, "acceptance_length"))],
        ),
    ]
    panels = [(title, ylabel, [(n, c) for n, c in lines if c[0]]) for title, ylabel, lines in panels]
    panels = [p for p in panels if p[2]]
    if not panels:
        raise UsageError("no metrics to plot yet")
    fig, axes = pyplot.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (title, ylabel, lines) in zip(axes[0], panels):
        for name, (xs, ys) in lines:
            ax.plot(xs, ys, label=name, marker=None if name == "training" else "o", markersize=3)
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
