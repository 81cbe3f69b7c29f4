"""Live output of every rank, each line prefixed with its host and rank.

On a terminal the prefixes are coloured per rank (rich); piped, they are plain text, so
logs stay greppable: ``studio-1 r0 | step 10/100  loss 1.2345``. The ranks' status
frames (see :class:`~meshtrain.heartbeat.StatusReporter`) are taken out of the
lines here and handed to :meth:`RankOutput.status`; control characters left in a line
(escape sequences) are shown as ``\x1b`` and the like; this plain output ignores them, the
live panel (:class:`~meshtrain.launch.live.LiveOutput`) shows them.

With ``log_dir`` every rank's lines are also written to ``<log_dir>/<host>-r<rank>.log``
as they arrive (the launch command keeps them with the run directory).
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from pathlib import Path
from types import TracebackType
from typing import Protocol, TextIO

from rich.console import Console
from rich.text import Text

from meshtrain import observers
from meshtrain.heartbeat import RankStatus, split_status
from meshtrain.hosts.host_output import visible

COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")
TAIL_LINES = 20
STOPPED = "stopped by the launcher"  # the outcome of a rank torn down after another failed
# A rank's state as the live view and the dashboard show it, once it has ended.
DONE, FAILED, LOST, STOPPED_STATE = "done", "failed", "lost", "stopped"
# The launcher's reasons for a rank it can no longer hear (see launcher._outcome).
_LOST_REASONS = ("lost connection", "stopped answering", "sent no heartbeat")


def state_for_outcome(outcome: str) -> str:
    """The row state for a launcher outcome ("ok", :data:`STOPPED`, or a failure reason)."""
    if outcome == "ok":
        return DONE
    if outcome == STOPPED:
        return STOPPED_STATE
    return LOST if outcome.startswith(_LOST_REASONS) else FAILED


class BeatSource(Protocol):
    """Where the launcher times a rank's heartbeats (a RemoteProcess)."""

    last_beat: float | None  # monotonic time of the last beat; None before the first


class RankOutput:
    """Prints the lines of all ranks without interleaving them, keeping each rank's tail."""

    def __init__(self, names: list[str], stream: TextIO | None = None,
                 force_terminal: bool | None = None, log_dir: Path | None = None) -> None:
        self.stream = stream or sys.stdout
        self.console = Console(file=self.stream, highlight=False, soft_wrap=True,
                               force_terminal=force_terminal)
        self.names = list(names)
        width = max(len(n) for n in names) + len(f" r{len(names) - 1}")
        self.prefixes = [f"{name} r{rank}".ljust(width) for rank, name in enumerate(names)]
        self.tails: list[deque[str]] = [deque(maxlen=TAIL_LINES) for _ in names]
        self.log_dir = log_dir
        self.log_paths = [log_dir / f"{name}-r{rank}.log" for rank, name in enumerate(names)] \
            if log_dir is not None else []
        self._logs: dict[int, TextIO] = {}
        self.log_error: str | None = None  # why the per-rank logs stopped being written
        self._pending = [""] * len(names)  # the start of a line a status frame cut short
        self._lock = threading.Lock()

    def line(self, rank: int, text: str) -> None:
        """Handle one line of ``rank``'s output: statuses out, the rest printed, logged
        and remembered for failure reports."""
        text, statuses, cut_short = split_status(text)
        with self._lock:
            for status in statuses:
                self._status(rank, status)
                observers.notify("node_update", observers.NodeUpdate.from_status(rank, status))
            observers.notify("node_heard", rank)
            text, self._pending[rank] = self._pending[rank] + text, ""
            if cut_short:  # the program's line goes on in the next one
                self._pending[rank] = text
                return
            self._emit(rank, text)

    def ended(self, rank: int, outcome: str) -> None:
        """``rank`` stopped: "ok", :data:`STOPPED`, or why it failed. Prints what is left
        of its output; the first outcome given counts."""
        with self._lock:
            if self._pending[rank]:
                text, self._pending[rank] = self._pending[rank], ""
                self._emit(rank, text)
            if rank in self._logs:
                self._logs.pop(rank).close()
            self._ended(rank, outcome)
            state = state_for_outcome(outcome)
            observers.notify("node_ended", rank, state, outcome if state in ("failed", "lost") else None)

    def watch(self, rank: int, source: BeatSource) -> None:
        """``rank`` was started (again, on a restart); ``source`` times its heartbeats
        (plain output does not show them)."""
        observers.notify("node_started", rank)

    def note(self, text: str, style: str = "bold") -> None:
        """A line from the launcher itself."""
        observers.notify("event", "note", text)
        with self._lock:
            if self.console.is_terminal:
                self.console.print(Text(f"meshtrain: {text}", style=style))
            else:
                self.stream.write(f"meshtrain: {text}\n")
                self.stream.flush()

    def add_row(self, name: str) -> int:
        """A host added to the run while it trains (``meshtrain hosts add``): its row, the next."""
        with self._lock:
            row = len(self.names)
            self.names.append(name)
            self.prefixes.append(f"{name} r{row}".ljust(len(self.prefixes[0]) if self.prefixes else 0))
            self.tails.append(deque(maxlen=TAIL_LINES))
            if self.log_dir is not None:
                self.log_paths.append(self.log_dir / f"{name}-r{row}.log")
            self._pending.append("")
            self._added(row, name)
        observers.notify("node_added", name)
        return row

    def tail(self, rank: int) -> list[str]:
        """The last lines ``rank`` printed."""
        with self._lock:
            return list(self.tails[rank])

    def close(self) -> None:
        """Close the per-rank log files (idempotent)."""
        with self._lock:
            for f in self._logs.values():
                f.close()
            self._logs.clear()

    def __enter__(self) -> RankOutput:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def keep_logs(self, run_dir: Path | None) -> str | None:
        """After the launch: move the per-rank logs into ``run_dir/ranks`` (the copied-back
        run directory, if any) and say where they are; None if there are none."""
        self.close()
        if self.log_error is not None:
            return f"the rank logs are incomplete: {self.log_error}"
        if self.log_dir is None or not self.log_dir.is_dir():
            return None
        where = self.log_dir
        if run_dir is not None and run_dir.is_dir() and not (run_dir / "ranks").exists():
            try:
                os.replace(self.log_dir, run_dir / "ranks")
                where = run_dir / "ranks"
            except OSError:
                pass  # another filesystem or no permission: they stay where they were written
        return f"every rank's output: {where}/"

    # ------------------------------------------------------------ what subclasses change
    def _show(self, rank: int, text: str) -> None:
        """Print one line of ``rank`` (the lock is held)."""
        if self.console.is_terminal:
            colour = f"bold {COLOURS[rank % len(COLOURS)]}"
            self.console.print(Text.assemble((self.prefixes[rank] + " | ", colour), text))
        else:
            self.stream.write(f"{self.prefixes[rank]} | {text}\n")
            self.stream.flush()

    def _status(self, rank: int, status: RankStatus) -> None:
        """A status from ``rank`` (the lock is held); plain output shows none."""

    def _ended(self, rank: int, outcome: str) -> None:
        """``rank`` stopped (the lock is held)."""

    def _added(self, rank: int, name: str) -> None:
        """A row for a host added mid-run (the lock is held)."""

    def _emit(self, rank: int, text: str) -> None:
        text = visible(text)  # a host's escape sequences never reach the terminal or the logs
        self.tails[rank].append(text)
        self._log(rank, text)
        self._show(rank, text)

    def _log(self, rank: int, text: str) -> None:
        if self.log_dir is None or self.log_error is not None:
            return
        try:
            f = self._logs.get(rank)
            if f is None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                # Appended line by line, so `tail -f` follows a rank during the run.
                f = self._logs[rank] = open(self.log_paths[rank], "a", encoding="utf-8")  # noqa: SIM115
            f.write(text + "\n")
            f.flush()
        except OSError as exc:  # a full disk must not stop the run (this is a reader thread)
            self.log_error = f"{exc.strerror or exc} ({exc.filename or self.log_dir})"
