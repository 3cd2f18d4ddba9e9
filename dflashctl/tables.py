"""Tables for people and for pipes.

On a terminal: a rich table whose ids and states never wrap or get cut (a cut id cannot be copied
into the next command) and whose free-text columns fold; a terminal too narrow for every column
loses the least important ones first (each column says when it may go) and a dim line below the
table names them. Anywhere else (a pipe, a file): plain columns aligned with spaces at any width,
as kubectl prints them, so that `dflashctl runs list | grep succeeded` finds whole words; a cell
longer than PLAIN_ALIGN_MAX sticks out of its own row instead of widening every row. Long explanations (evidence, hints,
refusals) do not belong in a cell: `notes` prints them below the table, one per line. `fields`
prints one record as label and value rows (`runs show`) by the same rules: folded on a terminal,
one whole line each in a pipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

Cell = "str | Text"
PLAIN_ALIGN_MAX = 40  # in a pipe, longer cells do not widen their column (one huge name, one long line)
TEXT_MIN = 10  # a free-text column folds, but not narrower than this (or its header)


@dataclass(frozen=True)
class Column:
    """One column: its header, its alignment, whether it is free text (may fold), and when it may be
    hidden on a narrow terminal (drop: 0 never; of the others, the highest goes first)."""

    name: str
    justify: str = "left"
    text: bool = False
    drop: int = 0


def show(
    console: Console,
    columns: Sequence[Column],
    rows: Sequence[Sequence["str | Text"]],
    title: str | None = None,
    sections: Sequence[int] = (),
    legend: Sequence[tuple[str, str]] = (),
) -> None:
    """Print rows under columns: rich on a terminal, plain aligned columns otherwise.
    `sections`: row indices that start a new section (a rule above them, on a terminal).
    `legend`: (column name, line) pairs, each line dim below the table on a terminal where that
    column is drawn (its marks explained); a pipe keeps one row per line."""
    if not console.is_terminal:
        _plain(console, columns, rows)
        return
    cells = [[cell if isinstance(cell, Text) else Text(str(cell)) for cell in row] for row in rows]
    kept = _fitting(console.width, columns, cells)
    table = Table(title=Text(title) if title else None, title_justify="left")
    for i in kept:
        col = columns[i]
        table.add_column(
            col.name, justify=col.justify, no_wrap=not col.text, overflow="fold" if col.text else "ellipsis"
        )
    for r, row in enumerate(cells):
        if r in sections:
            table.add_section()
        table.add_row(*(row[i] for i in kept))
    console.print(table)
    drawn = {columns[i].name for i in kept}
    for name, line in legend:
        if name in drawn:
            console.print(Text(line, style="dim"), highlight=False)
    hidden = [col.name for i, col in enumerate(columns) if i not in kept]
    if hidden:
        console.print(
            Text(
                f"hidden at {console.width} columns: {', '.join(hidden)} (a wider terminal or --json shows them)",
                style="dim",
            ),
            highlight=False,
        )


def _fitting(width: int, columns: Sequence[Column], cells: Sequence[Sequence[Text]]) -> list[int]:
    """Indices of the columns to draw: all that fit in width, dropping the highest `drop` first."""

    def need(i: int) -> int:
        col = columns[i]
        natural = max([len(col.name), *(row[i].cell_len for row in cells)])
        return min(natural, max(len(col.name), TEXT_MIN)) if col.text else natural

    kept = list(range(len(columns)))
    droppable = sorted((i for i, col in enumerate(columns) if col.drop), key=lambda i: -columns[i].drop)
    # rich's default box: one border left, then each column's two spaces of padding and its right border.
    while droppable and 1 + sum(need(i) + 3 for i in kept) > width:
        kept.remove(droppable.pop(0))
    return kept


def _plain(console: Console, columns: Sequence[Column], rows: Sequence[Sequence["str | Text"]]) -> None:
    cells = [[(cell.plain if isinstance(cell, Text) else str(cell)).replace("\n", " ") for cell in row] for row in rows]
    header = [col.name.upper() for col in columns]
    widths = [
        max([len(header[i]), *(len(r[i]) for r in cells if len(r[i]) <= PLAIN_ALIGN_MAX)]) for i in range(len(columns))
    ]

    def line(values: Sequence[str]) -> str:
        padded = [v.rjust(w) if col.justify == "right" else v.ljust(w) for v, w, col in zip(values, widths, columns)]
        return "  ".join(padded).rstrip()

    for text in [line(header), *(line(r) for r in cells)]:
        console.print(Text(text), soft_wrap=True, highlight=False, markup=False)


def fields(console: Console, rows: Sequence[tuple[str, Text]]) -> None:
    """Label and value, one pair a row (`runs show`): on a terminal two borderless columns whose values
    fold, never cut; in a pipe `label  value` on one line each, values whole at any width."""
    if not console.is_terminal:
        width = max((len(label) for label, _ in rows), default=0)
        for label, value in rows:
            line = label.ljust(width) + "  " + value.plain.replace("\n", " ")
            console.print(Text(line.rstrip()), soft_wrap=True, highlight=False, markup=False)
        return
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")  # a long path or override folds: a cut one cannot be copied
    for label, value in rows:
        table.add_row(label, value)
    console.print(table)


def notes(console: Console, items: Sequence[tuple[str, str, str]]) -> None:
    """Below a table: `label: detail` and an indented `hint: ...`; on a terminal wrapped between
    words, in a pipe one line each."""
    wrap = not console.is_terminal  # in a pipe a note stays one line, like the rows
    for label, detail, hint in items:
        if detail:
            console.print(Text(f"{label}: ", style="bold") + Text(detail), highlight=False, soft_wrap=wrap)
        if hint:
            console.print(Text("  hint: ", style="cyan") + Text(hint), highlight=False, soft_wrap=wrap)


def counted(n: int, noun: str) -> str:
    """`1 row`, `0 rows`, `12 rows`: a count as one reads it (nouns that add an s)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
