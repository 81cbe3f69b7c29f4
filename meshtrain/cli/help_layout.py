"""Help screens that never cut an option's name, and whose sentences wrap where the
terminal ends.

typer draws each panel of ``--help`` as a rich table whose columns may all shrink; at 80
columns a long help word ("rendezvous.heartbeat_timeout,") made rich shorten the names
column to "--accept-new-host-k…". Here every column but the last (the help text) keeps
its full width and the help text folds instead: a name is always shown whole, so it can
be copied. When the names leave the help text less than :data:`MIN_HELP_WIDTH` columns
(one long pair like "--gradient-checkpointing --no-gradient-checkpointing" widens the
names of a whole panel: at 80 columns, and whenever piped, every description of the
"What to train" panel was cut to "P…", "n…"), the panel lists each option's names on a
line of their own and its help below them, indented, wrapped at the panel's width.

In its "rich" markup mode typer keeps a docstring's line breaks, so a paragraph wrapped at
90 characters in the source broke twice at 80 columns ("For a live run," alone on a line)
and ran short at 120. :func:`reflow_command_help` gives every command its docstring with
each prose line run together, for rich to wrap; indented lines (examples) stay as written.
"""

from __future__ import annotations

import inspect
from typing import Any

import typer
import typer.rich_utils
from rich.columns import Columns
from rich.console import Console, ConsoleOptions, RenderResult
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

#: Fewest columns a help text gets beside the option names; below it the panel stacks
#: each option's help under its names (about five words a line).
MIN_HELP_WIDTH = 30
#: How far a stacked help text is indented under its option's names.
STACKED_HELP_INDENT = 4


class WholeNamesTable(Table):
    """A help panel's table: names, short flags and types never wrap or shrink; the
    help text (the last column) takes what width is left, folding long words."""

    def add_row(self, *renderables: Any, **kwargs: Any) -> None:
        *names, help_text = renderables
        parts = help_text.renderables if isinstance(help_text, Columns) else []
        texts = [part for part in parts if isinstance(part, Text)]
        if texts and len(texts) == len(parts):
            # typer sets the help and its "[default: ...]" side by side in Columns, which cut a
            # word longer than the column with "…" (a URL in an example): one text folds it.
            help_text = Text(" ").join(texts)
        super().add_row(*names, help_text, **kwargs)
        for column in self.columns[:-1]:
            column.no_wrap = True
        self.columns[-1].overflow = "fold"

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if len(self.columns) < 2 or self._help_width(console, options) >= MIN_HELP_WIDTH:
            yield from super().__rich_console__(console, options)
            return
        yield self._stacked()

    def _help_width(self, console: Console, options: ConsoleOptions) -> int:
        """The help column's width in the table as rich would lay it out here (the same
        computation as :meth:`Table.__rich_console__`'s)."""
        width = (self.width or options.max_width) - self._extra_width
        return self._calculate_column_widths(console, options.update_width(width))[-1]

    def _stacked(self) -> Table:
        """One option after another: its names (and type) on a line, whole; its help below,
        indented, wrapped at the whole width."""
        stacked = Table.grid(expand=True)
        stacked.add_column(overflow="fold")
        columns = [list(column.cells) for column in self.columns]
        for row in range(self.row_count):
            names = [cell if isinstance(cell, Text) else Text(str(cell))
                     for cell in (column[row] for column in columns[:-1])]
            stacked.add_row(Text(" ").join(name for name in names if name.plain.strip()))
            stacked.add_row(Padding(columns[-1][row], (0, 0, 0, STACKED_HELP_INDENT)))
        return stacked


def keep_option_names_whole() -> None:
    """Make typer's help panels use :class:`WholeNamesTable` (its options and commands
    panels build their tables from ``typer.rich_utils.Table``)."""
    typer.rich_utils.Table = WholeNamesTable  # type: ignore[misc]


def reflowed(doc: str) -> str:
    """``doc`` (a docstring) with the lines of each prose paragraph joined by spaces;
    paragraphs, and indented lines (examples), kept as they are, for typer's help."""
    paragraphs = []
    for paragraph in inspect.cleandoc(doc).split("\n\n"):
        lines: list[str] = []
        for line in paragraph.splitlines():
            if lines and not line.startswith(" ") and not lines[-1].startswith(" "):
                lines[-1] = f"{lines[-1]} {line.strip()}"
            else:
                lines.append(line)
        paragraphs.append("\n".join(lines))
    first, *rest = paragraphs
    # typer dedents what follows the first paragraph by the indentation its lines share,
    # not counting the first of them: with one prose line before the examples, that took
    # the examples' indentation away. A blank line first makes that prose line count.
    return first if not rest else first + "\n\n\n" + "\n\n".join(rest)


def reflow_command_help(app: typer.Typer) -> None:
    """Give every command of ``app`` (and of its sub-apps) its docstring, :func:`reflowed`,
    as its help, where no help was given explicitly."""
    for command in app.registered_commands:
        if command.help is None and command.callback is not None and command.callback.__doc__:
            command.help = reflowed(command.callback.__doc__)
    for group in app.registered_groups:
        if group.typer_instance is not None:
            reflow_command_help(group.typer_instance)
