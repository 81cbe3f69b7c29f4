"""Rank 0's view of a run: a rich progress bar on a terminal, periodic lines elsewhere."""

from __future__ import annotations

import sys
from types import TracebackType

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError


class Progress:
    """Shows step, loss (mean of nodes) and bytes sent per node; does nothing when disabled."""

    def __init__(self, total: int, *, enabled: bool, title: str) -> None:
        self.total = total
        self.enabled = enabled
        self.title = title
        self.interactive = enabled and sys.stdout.isatty()
        self._bar: RichProgress | None = None
        self._next_line = 0
        self.lines: list[str] = []  # the plain progress lines, kept for the run's log.txt

    def __enter__(self) -> Progress:
        if self.interactive:
            self._bar = RichProgress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.4f}"),
                TextColumn("sent {task.fields[sent]}"),
                TimeElapsedColumn(),
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(self.title, total=self.total, loss=float("nan"), sent="0 B")
        return self

    def update(self, step: int, loss: float, bytes_sent: float) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=loss, sent=human_bytes(bytes_sent))
        if step >= self._next_line or step == self.total:
            # Plain lines (piped or streamed from remote ranks, and the log): about ten per run.
            line = f"step {step}/{self.total}  loss {loss:.4f}  sent {human_bytes(bytes_sent)}"
            self.lines.append(line)
            if self._bar is None:
                print(line, flush=True)
            self._next_line = step + max(1, self.total // 10)

    def note(self, line: str) -> None:
        """An event worth a line of its own (a node leaving), above the bar and in the log."""
        if not self.enabled:
            return
        self.lines.append(line)
        if self._bar is not None:
            self._bar.console.print(line, highlight=False, markup=False)
        else:
            print(line, flush=True)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.__exit__(exc_type, exc, tb)
