"""Live output of every rank, each line prefixed with its host and rank.

On a terminal the prefixes are coloured per rank (rich); piped, they are plain text, so
logs stay greppable: ``studio-1 r0 | step 10/100  loss 1.2345``.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from typing import TextIO

from rich.console import Console
from rich.text import Text

COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")
TAIL_LINES = 20


class RankOutput:
    """Prints the lines of all ranks without interleaving them, keeping each rank's tail."""

    def __init__(self, names: list[str], stream: TextIO | None = None,
                 force_terminal: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.console = Console(file=self.stream, highlight=False, soft_wrap=True,
                               force_terminal=force_terminal)
        width = max(len(n) for n in names) + len(f" r{len(names) - 1}")
        self.prefixes = [f"{name} r{rank}".ljust(width) for rank, name in enumerate(names)]
        self.tails: list[deque[str]] = [deque(maxlen=TAIL_LINES) for _ in names]
        self._lock = threading.Lock()

    def line(self, rank: int, text: str) -> None:
        """Print one line of ``rank``'s output (and remember it for failure reports)."""
        with self._lock:
            self.tails[rank].append(text)
            if self.console.is_terminal:
                colour = f"bold {COLOURS[rank % len(COLOURS)]}"
                self.console.print(Text.assemble((self.prefixes[rank] + " | ", colour), text))
            else:
                self.stream.write(f"{self.prefixes[rank]} | {text}\n")
                self.stream.flush()

    def note(self, text: str, style: str = "bold") -> None:
        """A line from the launcher itself."""
        with self._lock:
            if self.console.is_terminal:
                self.console.print(Text(f"meshtrain: {text}", style=style))
            else:
                self.stream.write(f"meshtrain: {text}\n")
                self.stream.flush()

    def tail(self, rank: int) -> list[str]:
        """The last lines ``rank`` printed."""
        with self._lock:
            return list(self.tails[rank])
