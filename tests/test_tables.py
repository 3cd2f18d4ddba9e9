"""Tables on a narrow terminal and in a pipe (issue 29 items 5 and 7): rich Consoles in-process,
their width and terminal-ness forced, so the rendering is exactly what a user at that width sees."""

from __future__ import annotations

import io

from rich.console import Console

from dflashctl.runs import print_runs
from dflashctl.tables import Column, show

RUNS = [
    {
        "run_id": "20261202-023745-a1b2",
        "name": "qwen3 8b drafter, long context sweep",
        "kind": "train",
        "state": "succeeded",
        "exit_code": 0,
        "gpus": ["0", "1", "2", "3"],
        "started_at": "2026-12-02T02:37:45Z",
        "started_ts": 1.0,
        "ended_ts": 3700.0,
        "last": {"step": 60, "total_steps": 60, "loss": 1.2345, "spec_tau": 3.1},
    },
    {
        "run_id": "20261202-031500-ffff",
        "name": None,
        "kind": "data",
        "state": "failed",
        "exit_code": 100,
        "gpus": ["cpu"],
        "started_at": "2026-12-02T03:15:00Z",
        "started_ts": 2.0,
        "ended_ts": 62.0,
        "last": {"rows_done": 20, "rows_total": 60},
    },
]


def terminal(width: int) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=width, force_terminal=True, color_system=None, legacy_windows=False), buf


def test_runs_list_at_80_columns_keeps_ids_names_and_states_whole():
    console, buf = terminal(80)
    print_runs(console, RUNS, "shim (pct 200)")
    out = buf.getvalue()
    assert "…" not in out
    assert all(len(line) <= 80 for line in out.splitlines())
    for run in RUNS:
        assert run["run_id"] in out
    assert "succeeded" in out and "failed (100)" in out
    words = out.replace("│", " ").split()
    assert all(w in words for w in ("qwen3", "8b", "drafter,")), out  # the name is folded, not cut
    assert "hidden at 80 columns: kind, GPUs, started, duration" in out  # and says what it left out


def test_a_wide_terminal_shows_every_column():
    console, buf = terminal(200)
    print_runs(console, RUNS, "shim")
    out = buf.getvalue()
    assert "12-02 02:37" in out and "1:01:39" in out and "hidden at" not in out


def test_a_terminal_too_narrow_for_anything_still_never_cuts_an_id():
    console, buf = terminal(40)
    print_runs(console, RUNS, "shim")
    assert RUNS[0]["run_id"] in buf.getvalue()


def test_a_piped_table_is_not_padded_to_its_longest_cell():
    buf = io.StringIO()
    console = Console(file=buf, width=80, force_terminal=False)
    rows = [["a", "x" * 2000, "ok"], ["b", "short", "ok"], ["c", "name", "failed"]]
    show(console, [Column("id"), Column("name", text=True), Column("state")], rows)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 4 and len(lines[1]) == len("a   ") + 2000 + len("  ok")
    assert lines[2] == "b   short  ok" and lines[3] == "c   name   failed"  # aligned among themselves
