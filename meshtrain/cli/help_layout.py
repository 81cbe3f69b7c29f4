"""Help screens that never cut an option's name, and whose sentences wrap where the
terminal ends.

typer draws each panel of ``--help`` as a rich table whose columns may all shrink; at 80
columns a long help word ("rendezvous.heartbeat_timeout,") made rich shorten the names
column to "--accept-new-host-k…". Here every column but the last (the help text) keeps
its full width and the help text folds instead: a name is always shown whole, so it can
be copied.

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
from rich.table import Table


class WholeNamesTable(Table):
    """A help panel's table: names, short flags and types never wrap or shrink; the
    help text (the last column) takes what width is left, folding long words."""

    def add_row(self, *renderables: Any, **kwargs: Any) -> None:
        super().add_row(*renderables, **kwargs)
        for column in self.columns[:-1]:
            column.no_wrap = True
        self.columns[-1].overflow = "fold"


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
