"""Help screens that never cut an option's name.

typer draws each panel of ``--help`` as a rich table whose columns may all shrink; at 80
columns a long help word ("rendezvous.heartbeat_timeout,") made rich shorten the names
column to "--accept-new-host-k…". Here every column but the last (the help text) keeps
its full width and the help text folds instead: a name is always shown whole, so it can
be copied.
"""

from __future__ import annotations

from typing import Any

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
