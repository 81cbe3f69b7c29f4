"""Tables that stay readable on a narrow terminal.

rich fits a table to the terminal by shortening its cells ("stu…", "123…") or leaving whole
columns out. :func:`fitted` shows the table where every word of it fits, and otherwise
each row as its first cell on a line of its own with the other cells under it, each after
its column's header ("loss 2.3456  sent 123.46 MB"), packed into lines without splitting one.
"""

from __future__ import annotations

import sys

from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Column, Table
from rich.text import Text


def fitted(table: Table, console: Console) -> Table | Group:
    """``table`` itself where ``console`` is wide enough to show every word of it whole;
    otherwise its rows as lines of named cells. Cells are text (str or Text)."""
    if _narrowest(table, console) <= console.width:
        return table
    lines: list[RenderableType] = []
    if table.title:
        lines.append(Text(str(table.title), style="italic"))
    headers = [str(column.header) for column in table.columns]
    for first, *cells in zip(*(_texts(column) for column in table.columns), strict=True):
        name = first.copy()
        name.stylize("bold")
        lines.append(name)
        named = [Text.assemble(f"{header} ", cell) for header, cell in zip(headers[1:], cells, strict=True)]
        lines.extend(Padding(Text("  ").join(line), (0, 0, 0, 2), expand=False)
                     for line in _packed(named, console.width - 2))
    if table.caption:
        lines.append(Text(str(table.caption)))
    return Group(*lines)


def _packed(pieces: list[Text], width: int) -> list[list[Text]]:
    """``pieces`` in lines of at most ``width`` cells, two spaces apart, none split between
    lines ("projected 0.05" and "s" had been); one wider than a line has a line of its own."""
    lines: list[list[Text]] = []
    used = width + 1  # the first piece opens a line
    for piece in pieces:
        if used + 2 + piece.cell_len > width:
            lines.append([])
            used = -2
        lines[-1].append(piece)
        used += 2 + piece.cell_len
    return lines


def _texts(column: Column) -> list[Text]:
    # A str cell is rich markup, as the table itself would render it ("[bold]ranks[/]").
    return [cell if isinstance(cell, Text) else Text.from_markup(str(cell)) for cell in column.cells]


def _narrowest(table: Table, console: Console) -> int:
    """The fewest columns ``table`` needs to show every word whole (rich's measure of a
    table never exceeds the width it is given: given no bound, it says what it needs)."""
    return Measurement.get(console, console.options.update_width(10**6), table).minimum


def print_fitted(table: Table, *, piped_width: int | None = None) -> None:
    """Print ``table`` on stdout: on a terminal :func:`fitted` to its width; piped (a file,
    a log, a table copied into the README) as wide as ``piped_width`` (rich's default where
    None), exactly as before. The benchmarks' tables, 140-250 columns wide, had been printed
    at that width on an 80-column terminal too, every line wrapped by the terminal."""
    if sys.stdout.isatty():
        console = Console()
        console.print(fitted(table, console))
    else:
        Console(width=piped_width).print(table)
