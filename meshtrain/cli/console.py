"""Where every command prints: its consoles and :func:`fail`, the one way to stop with
one clear line."""

from __future__ import annotations

import os
import sys

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from meshtrain.errors import MeshtrainError
from meshtrain.hosts.host_output import visible
from meshtrain.tables import fitted

#: Piped output (a file, tee, CI) is not cut at 80 columns: a line is as wide as its table.
#: A terminal's own width rules, and so does COLUMNS where it is set.
PIPED_WIDTH = 1000
console = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else PIPED_WIDTH)
# The hosts and launch commands' tables: piped output (CI logs, tests) gets room for the
# whole table rather than 80 columns.
wide_console = Console(width=None if sys.stdout.isatty() else 160)
errors = Console(stderr=True)


def terminal_text(message: str) -> str:
    """``message`` as the terminal may show it: every control character but newline and tab
    written out (ESC as ``\\x1b``). An exception's text can quote a host, a file or a
    model's output, and an escape sequence in it would otherwise act on the terminal."""
    return "\n".join(visible(line) for line in message.split("\n"))


def error_line(message: str, label: str = "error: ") -> Text:
    """``label`` in bold red, then ``message`` as plain text: never markup (a message may hold
    brackets, "pip install 'meshtrain[wandb]'" or a host's "[/]"), control characters written out."""
    return Text.assemble((label, "bold red"), terminal_text(message))


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print one clear line (no traceback) and return the exit to raise."""
    errors.print(error_line(message), soft_wrap=True)
    return typer.Exit(code)


def fail_on(exc: MeshtrainError) -> typer.Exit:
    """Stop with ``exc``'s one line and its kind's exit status (2 bad input, 1 a failure)."""
    return fail(str(exc), exc.exit_code)


def print_table(table: Table, out: Console = console) -> None:
    """Print ``table`` on ``out``, whole where it fits and as rows of named cells where the
    terminal is too narrow (:func:`meshtrain.tables.fitted`)."""
    out.print(fitted(table, out))
