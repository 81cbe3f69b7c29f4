"""The live view of a launch: one row per host above the streamed log, on a terminal.

    ┏━━━━━━┳━━━━━━┳━━━━━━━━━━┳━━━━━━━┳━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━━━┳━━━━━━━━━┳━━━━━━┳━━━━━━━━━┳━━━━━━━┓
    ┃ host ┃ rank ┃ state    ┃  step ┃   loss ┃ steps/s ┃ last sync ┃    sent ┃  CPU ┃  memory ┃ heard ┃
    ┡━━━━━━╇━━━━━━╇━━━━━━━━━━╇━━━━━━━╇━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━━━╇━━━━━━━━━╇━━━━━━╇━━━━━━━━━╇━━━━━━━┩
    │ box0 │    0 │ training │ 12/20 │ 0.5312 │     8.1 │        10 │ 1.23 MB │ 98 % │ 310 MB  │ 0.2 s │

With ``--balance`` a "samples/step" column shows each host's share of the step's samples,
and where a rank's torch holds GPU (CUDA) or Apple GPU (MPS) memory a "GPU memory" column
shows it.

Two parts, kept apart so the model can be tested without a terminal:

* :class:`ClusterView` (pure data): folds the ranks' :class:`RankStatus` messages,
  their heartbeats and how each ended into one :class:`~meshtrain.observers.NodeRow` per
  host (the row the web dashboard shows too).
* :func:`render_cluster` turns it into a rich table; :class:`LiveOutput` is the
  :class:`RankOutput` that shows that table with the latest log lines under it in a
  rich ``Live`` display (every line still goes to the per-rank logs).

States: starting (no status yet), training, finishing (past the last step: final
evaluation, writing the run directory), done, failed (exited non-zero or could not
start), lost (connection lost, host or process silent), stopped (by the launcher,
after another rank failed or on Ctrl-C).
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TextIO

from rich.console import Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from meshtrain import observers
from meshtrain.heartbeat import RankStatus
from meshtrain.launch.output import (
    COLOURS,
    DONE,
    FAILED,
    LOST,
    STOPPED_STATE,
    BeatSource,
    RankOutput,
    state_for_outcome,
)
from meshtrain.observers import FINISHING, STARTING, TRAINING, NodeRow, NodeUpdate
from meshtrain.progress import human_bytes
from meshtrain.tables import fitted

STATE_STYLES = {STARTING: "dim", TRAINING: "green", FINISHING: "cyan", DONE: "bold green",
                FAILED: "bold red", LOST: "bold red", STOPPED_STATE: "yellow"}
LOG_LINES = 200  # log lines the live view keeps; it shows as many as the terminal fits
#: Redraws per second. Each redraw renders the whole panel and the visible log lines
#: (~6 ms of CPU on a 160x50 terminal); at 4 a second the live view took 2.5% of a core
#: on the launching machine, often one of the hosts (benchmarks/live_view_cpu.py).
REFRESH_PER_SECOND = 2


class ClusterView:
    """The panel's model: one :class:`~meshtrain.observers.NodeRow` per rank (the dashboard's
    row too), updated from what ranks send.

    Pure data: every method takes the time it happened at, so a stream of messages can
    be replayed in a test.
    """

    def __init__(self, names: list[str]) -> None:
        self.rows = [NodeRow(name, rank) for rank, name in enumerate(names)]

    def started(self, rank: int) -> None:
        """``rank`` was started (again, on a restart): its row begins afresh."""
        self.rows[rank] = NodeRow(self.rows[rank].name, rank)

    def fold(self, rank: int, status: RankStatus, now: float) -> None:
        """Take in a status message from ``rank`` received at ``now``."""
        row = self.rows[rank]
        if row.ended_at is not None:
            return  # a late message does not bring a stopped rank back
        self.heard(rank, now)
        row.take(NodeUpdate.from_status(rank, status))

    def heard(self, rank: int, when: float | None) -> None:
        """``rank`` was heard from at ``when`` (a beat, a status, a line); None: not yet.
        Once it stopped, how long it had been silent stays as it was."""
        row = self.rows[rank]
        if row.ended_at is None and when is not None and (row.last_heard is None or when > row.last_heard):
            row.last_heard = when

    def ended(self, rank: int, outcome: str, now: float) -> None:
        """``rank`` stopped with the launcher's ``outcome``; the first one counts."""
        row = self.rows[rank]
        if row.ended_at is not None:
            return
        row.ended_at = now
        row.state = state_for_outcome(outcome)
        if row.state in (FAILED, LOST):
            row.reason = outcome


def render_cluster(view: ClusterView, now: float, title: str | None = None) -> Table:
    """The panel: one row per host, ``now`` being the time the silences are measured to."""
    table = Table(title=title, title_justify="left", expand=False)
    table.add_column("host")
    table.add_column("rank", justify="right")
    table.add_column("state")
    shares = any(row.batch_size is not None for row in view.rows)  # --balance
    gpus = any(row.gpu_bytes is not None for row in view.rows)
    names = ["step", "loss", "steps/s", "last sync", *(["samples/step"] if shares else []), "sent",
             "CPU", "memory", *(["GPU memory"] if gpus else []), "heard"]
    for name in names:
        table.add_column(name, justify="right")
    for row in view.rows:
        silent = row.silent_for(now)
        state = Text(row.state, style=STATE_STYLES[row.state])
        if row.reason:
            state.append(f" ({row.reason})", style="red")
        table.add_row(
            Text(row.name, style=f"bold {COLOURS[row.rank % len(COLOURS)]}"),
            str(row.rank),
            state,
            _dash(row.step, lambda s, total=row.steps: str(s) if total is None else f"{s}/{total}"),
            _dash(row.loss, lambda v: f"{v:.4f}"),
            _dash(row.steps_per_second, lambda v: f"{v:.1f}"),
            _dash(row.last_sync, str),
            *([_dash(row.batch_size, str)] if shares else []),
            _dash(row.bytes_sent, human_bytes),
            _dash(row.cpu_percent, lambda v: f"{v:.0f} %"),
            _dash(row.rss_bytes, human_bytes),
            *([_dash(row.gpu_bytes, human_bytes)] if gpus else []),
            Text("-", style="dim") if silent is None else
            Text(f"{silent:.1f} s", style="bold yellow" if silent > 10 and row.ended_at is None else ""),
        )
    return table


def _dash(value: float | None, show: Callable[..., str]) -> Text:
    return Text("-", style="dim") if value is None else Text(show(value))


class LiveOutput(RankOutput):
    """Rank output shown as the live panel with the latest log lines under it.

    Use as a context manager around the launch: the display runs inside it, and its
    last frame stays on the terminal afterwards. Everything else (tails for failure
    reports, per-rank log files, status frames kept out of the text) is as in
    :class:`RankOutput`.
    """

    def __init__(self, names: list[str], stream: TextIO | None = None,
                 force_terminal: bool | None = None, log_dir: Path | None = None,
                 title: str | None = None, clock: Callable[[], float] = time.monotonic,
                 refresh_per_second: float = REFRESH_PER_SECOND) -> None:
        super().__init__(names, stream, force_terminal, log_dir)
        self.view = ClusterView(names)
        self.title = title
        self.clock = clock
        self.log: deque[Text] = deque(maxlen=LOG_LINES)
        self._sources: dict[int, BeatSource] = {}
        self.live = Live(console=self.console, get_renderable=self.renderable,
                         refresh_per_second=refresh_per_second, transient=False)

    def __enter__(self) -> LiveOutput:
        self.live.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.live.stop()  # draws the final frame once more and leaves it
        self.close()

    def watch(self, rank: int, source: BeatSource) -> None:
        super().watch(rank, source)  # tells the observers
        with self._lock:
            self.view.started(rank)
            self._sources[rank] = source

    def note(self, text: str, style: str = "bold") -> None:
        observers.notify("event", "note", text)
        with self._lock:
            self.log.append(Text(f"meshtrain: {text}", style=style, no_wrap=True, overflow="ellipsis"))

    def renderable(self) -> RenderableType:
        """The panel and, under it, as many recent log lines as the terminal has room for."""
        with self._lock:
            now = self.clock()
            for rank, source in self._sources.items():
                self.view.heard(rank, source.last_beat)
            table = render_cluster(self.view, now, self.title)
            panel = fitted(table, self.console)  # on a narrow terminal, a line or two per host
            # Under the panel, as many log lines as the terminal has room for.
            height = len(panel.renderables) if isinstance(panel, Group) else len(self.view.rows) + 6
            room = max(3, self.console.height - height - 1)
            return Group(panel, *list(self.log)[-room:])

    def _show(self, rank: int, text: str) -> None:
        self.view.heard(rank, self.clock())
        colour = f"bold {COLOURS[rank % len(COLOURS)]}"
        # One terminal row per line: the display must not grow past the screen.
        self.log.append(Text.assemble((self.prefixes[rank] + " | ", colour), text,
                                      no_wrap=True, overflow="ellipsis"))

    def _status(self, rank: int, status: RankStatus) -> None:
        self.view.fold(rank, status, self.clock())

    def _ended(self, rank: int, outcome: str) -> None:
        self.view.ended(rank, outcome, self.clock())

    def _added(self, rank: int, name: str) -> None:
        self.view.rows.append(NodeRow(name, rank))


def rank_output(names: list[str], *, plain: bool, log_dir: Path | None = None,
                title: str | None = None) -> RankOutput:
    """The output for a launch: the live panel on a terminal unless ``plain``, else
    today's prefixed lines (always when stdout is not a terminal: logs, pipes, CI)."""
    if not plain and sys.stdout.isatty():
        return LiveOutput(names, log_dir=log_dir, title=title)
    return RankOutput(names, log_dir=log_dir)
