"""Tables for people and for pipes.

On a terminal: a rich table whose ids, names and states never wrap (a cut id cannot be copied
into the next command) and whose free-text columns wrap only between words. Anywhere else (a
pipe, a file): plain columns aligned with spaces at any width, as kubectl prints them, so that
`dflashctl runs list | grep succeeded` finds whole words. Long explanations (evidence, hints,
refusals) do not belong in a cell: `notes` prints them below the table, one per line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

Cell = "str | Text"


@dataclass(frozen=True)
class Column:
    """One column: its header, its alignment, and whether it is free text (may wrap between words)."""

    name: str
    justify: str = "left"
    text: bool = False


def show(console: Console, columns: Sequence[Column], rows: Sequence[Sequence["str | Text"]],
         title: str | None = None, sections: Sequence[int] = ()) -> None:
    """Print rows under columns: rich on a terminal, plain aligned columns otherwise.
    `sections`: row indices that start a new section (a rule above them, on a terminal)."""
    if not console.is_terminal:
        _plain(console, columns, rows)
        return
    table = Table(title=Text(title) if title else None, title_justify="left")
    for col in columns:
        table.add_column(col.name, justify=col.justify, no_wrap=not col.text, overflow="fold" if col.text else "ellipsis")
    for i, row in enumerate(rows):
        if i in sections:
            table.add_section()
        table.add_row(*(cell if isinstance(cell, Text) else Text(str(cell)) for cell in row))
    console.print(table)


def _plain(console: Console, columns: Sequence[Column], rows: Sequence[Sequence["str | Text"]]) -> None:
    cells = [[(cell.plain if isinstance(cell, Text) else str(cell)).replace("\n", " ") for cell in row] for row in rows]
    header = [col.name.upper() for col in columns]
    widths = [max(len(header[i]), *(len(r[i]) for r in cells)) if cells else len(header[i]) for i in range(len(columns))]

    def line(values: Sequence[str]) -> str:
        padded = [v.rjust(w) if col.justify == "right" else v.ljust(w) for v, w, col in zip(values, widths, columns)]
        return "  ".join(padded).rstrip()

    for text in [line(header), *(line(r) for r in cells)]:
        console.print(Text(text), soft_wrap=True, highlight=False, markup=False)


def notes(console: Console, items: Sequence[tuple[str, str, str]]) -> None:
    """Below a table: `label: detail` and an indented `hint: ...`; on a terminal wrapped between
    words, in a pipe one line each."""
    wrap = not console.is_terminal  # in a pipe a note stays one line, like the rows
    for label, detail, hint in items:
        if detail:
            console.print(Text(f"{label}: ", style="bold") + Text(detail), highlight=False, soft_wrap=wrap)
        if hint:
            console.print(Text("  hint: ", style="cyan") + Text(hint), highlight=False, soft_wrap=wrap)
