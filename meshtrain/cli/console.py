"""Where every command prints: its consoles and :func:`fail`, the one way to stop with
one clear line."""

from __future__ import annotations

import os
import sys

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Column, Table
from rich.text import Text

from meshtrain.errors import MeshtrainError

#: Piped output (a file, tee, CI) is not cut at 80 columns: a line is as wide as its table.
#: A terminal's own width rules, and so does COLUMNS where it is set.
PIPED_WIDTH = 1000
console = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else PIPED_WIDTH)
# The hosts and launch commands' tables: piped output (CI logs, tests) gets room for the
# whole table rather than 80 columns.
wide_console = Console(width=None if sys.stdout.isatty() else 160)
errors = Console(stderr=True)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print one clear line (no traceback) and return the exit to raise."""
    # A Text, never markup: a message may hold brackets ("pip install 'meshtrain[wandb]'").
    errors.print(Text.assemble(("error: ", "bold red"), message), soft_wrap=True)
    return typer.Exit(code)


def fail_on(exc: MeshtrainError) -> typer.Exit:
    """Stop with ``exc``'s one line and its kind's exit status (2 bad input, 1 a failure)."""
    return fail(str(exc), exc.exit_code)


def print_table(table: Table, out: Console = console) -> None:
    """Print ``table`` on ``out``; or, on a terminal too narrow to show every word of it
    whole, each row as its first cell on a line of its own and the other cells below it,
    each after its column's header. rich would otherwise cut the cells short ("D…") or
    leave whole columns out. Cells are text (str or Text), as every table here holds."""
    if _narrowest(table, out) <= out.width:
        out.print(table)
        return
    if table.title:
        out.print(Text(str(table.title), style="italic"))
    headers = [str(column.header) for column in table.columns]
    for first, *cells in zip(*(_texts(column) for column in table.columns), strict=True):
        out.print(Text(first.plain, style="bold"))
        named = [Text.assemble(f"{header} ", cell) for header, cell in zip(headers[1:], cells, strict=True)]
        for line in _packed(named, out.width - 2):
            out.print(Padding(Text("  ").join(line), (0, 0, 0, 2), expand=False))
    if table.caption:
        out.print(Text(str(table.caption)))


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
    return [cell if isinstance(cell, Text) else Text(str(cell)) for cell in column.cells]


def _narrowest(table: Table, out: Console) -> int:
    """The fewest columns ``table`` needs to show every word whole (rich's measure of a
    table never exceeds the width it is given: given no bound, it says what it needs)."""
    return Measurement.get(out, out.options.update_width(10**6), table).minimum
