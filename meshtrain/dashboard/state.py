"""What the dashboard shows, as plain data: live runs fed by observer calls, finished runs
read from their run directories. No web server here: tests replay calls and read
:meth:`DashboardState.snapshot`.

Times are wall-clock (``time.time()``) so the browser can show "heard 0.4 s ago" against
the snapshot's ``now``; a clock is passed in so tests control it.
"""

from __future__ import annotations

import csv
import io
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from meshtrain import yaml12
from meshtrain.errors import InputError
from meshtrain.observers import STARTING, NodeRow, NodeUpdate

DONE, FAILED, LOST, STOPPED = "done", "failed", "lost", "stopped"
DAMAGED = "damaged"  # a run directory that could not be read: shown with why, not fatal
MAX_POINTS = 1500  # per series: older points are thinned, so a long run stays light to send
MAX_EVENTS = 500
MAX_NODES = 1024  # rows shown for a finished run (a damaged summary.json must not exhaust memory)


#: A run directory's summary.json, config.yaml and (thinned) metrics.csv rows.
RunFiles = tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]


class RunDirError(InputError):
    """A run directory that cannot be shown (one line naming the file at fault)."""


@dataclass
class Series:
    """Points of one curve: ``step``, ``loss``, ``bytes`` (sent so far), ``seconds`` (since
    the run started). Thinned to at most :data:`MAX_POINTS` by dropping every other point."""

    name: str
    points: list[list[float | None]] = field(default_factory=list)

    def add(self, step: float, loss: float | None, sent: float | None, seconds: float | None) -> None:
        if self.points and self.points[-1][0] == step:
            self.points[-1] = [step, loss, sent, seconds]  # the final status repeats the last step
            return
        self.points.append([step, loss, sent, seconds])
        if len(self.points) > MAX_POINTS:
            self.points = self.points[::2] + ([self.points[-1]] if len(self.points) % 2 == 0 else [])


class RunState:
    """One run on the dashboard, live or read from its directory."""

    def __init__(self, run_id: str, names: list[str], *, kind: str, clock: Callable[[], float],
                 changed: Callable[[], None], info: Mapping[str, Any] | None = None) -> None:
        self.run_id = run_id
        self.kind = kind  # "launch", "simulate" or "finished"
        self.clock = clock
        self._changed = changed
        self.started_at = clock()
        self.nodes = [NodeRow(name, rank) for rank, name in enumerate(names)]
        self.node_series = [Series(name) for name in names]
        self.mean_series: Series | None = None  # metrics.csv's train_loss (finished runs)
        self.val_series: Series | None = None
        self.projected: list[list[float]] = []  # [step, projected seconds], from metrics.csv
        self.measured: list[list[float]] = []  # [step, measured seconds]
        self.events: list[dict[str, Any]] = []
        self.info = dict(info or {})
        self.summary: dict[str, Any] | None = None
        self.status = "running" if kind != "finished" else "finished"

    # ------------------------------------------------------------ RunObserver
    def node_added(self, name: str) -> None:
        self.nodes.append(NodeRow(name, len(self.nodes)))
        self.node_series.append(Series(name))
        self._changed()

    def node_started(self, node: int) -> None:
        row = self.nodes[node]
        if row.state != STARTING or row.step is not None:  # a restart: the row begins afresh
            self.nodes[node] = NodeRow(row.name, row.rank, restarts=row.restarts + 1,
                                       last_heard=row.last_heard)
        self._changed()

    def node_update(self, update: NodeUpdate) -> None:
        row = self.nodes[update.node]
        if row.state in (DONE, FAILED, LOST, STOPPED):
            return  # a late message does not bring a stopped node back
        now = self.clock()
        row.last_heard = now
        row.take(update)
        if update.loss is not None and update.step > 0:
            self.node_series[update.node].add(update.step, update.loss, update.bytes_sent,
                                              now - self.started_at)
        if update.node == 0 and update.step > 0:
            self.measured.append([update.step, now - self.started_at])
            if len(self.measured) > MAX_POINTS:
                self.measured = self.measured[::2]
        self._changed()

    def node_heard(self, node: int) -> None:
        row = self.nodes[node]
        if row.state not in (DONE, FAILED, LOST, STOPPED):
            row.last_heard = self.clock()
            self._changed()

    def node_ended(self, node: int, state: str, reason: str | None) -> None:
        row = self.nodes[node]
        if row.state in (DONE, FAILED, LOST, STOPPED):
            return
        row.state, row.reason = state, reason
        if state in (FAILED, LOST):
            self.event("lost" if state == LOST else "failed",
                       f"{row.name} {'lost' if state == LOST else 'failed'}: {reason}", node)
        self._changed()

    def event(self, kind: str, text: str, node: int | None = None) -> None:
        if kind == "note" and text.startswith("restart "):
            kind = "restart"
        self.events.append({"time": self.clock(), "kind": kind, "text": text, "node": node})
        del self.events[:-MAX_EVENTS]
        self._changed()

    def run_finished(self, summary: Mapping[str, Any], history: list[dict[str, Any]]) -> None:
        self.summary = dict(summary)
        self._take_history(history)
        for row in self.nodes:
            if row.state not in (FAILED, LOST, STOPPED):
                row.state = DONE
        self.status = "finished"
        self._changed()

    # ------------------------------------------------------------ the CLI's calls
    def failed(self, message: str) -> None:
        """The run failed or was interrupted (the CLI's one-line error)."""
        self.status = "failed"
        self.event("failed", message)

    def ended(self) -> None:
        """The run is over, whatever became of it (the launcher returned)."""
        if self.status == "running":
            self.status = "finished"
        self._changed()

    def load_directory(self, run_dir: Path, read: RunFiles | None = None) -> None:
        """Take summary.json, config.yaml and metrics.csv from a finished run's directory
        (``read``: what :func:`read_run_directory` returned for it, when already read)."""
        summary, config, history = read or read_run_directory(run_dir)
        self.info.setdefault("config", config)
        self.info["run_dir"] = str(run_dir)
        self.summary = summary
        self._take_history(history)
        self._changed()

    def _take_history(self, history: Iterable[Mapping[str, Any]]) -> None:
        mean, val = Series("train loss (mean of nodes)"), Series("val loss (global model)")
        self.projected = []
        measured = []
        for row in history:
            step = _number(row.get("step"))
            if step is None:
                continue
            sent, seconds = _number(row.get("total_bytes_sent")), _number(row.get("seconds"))
            if step > 0 and _number(row.get("train_loss")) is not None:
                mean.add(step, _number(row.get("train_loss")), sent, seconds)
            if _number(row.get("val_loss")) is not None:
                val.add(step, _number(row.get("val_loss")), sent, seconds)
            projected = _number(row.get("projected_seconds"))
            if projected is not None:
                self.projected.append([step, projected])
            if seconds is not None and step > 0:
                measured.append([step, seconds])
        self.mean_series = mean if mean.points else None
        self.val_series = val if val.points else None
        if measured:
            self.measured = measured[:: max(1, len(measured) // MAX_POINTS)]
        self.projected = self.projected[:: max(1, len(self.projected) // MAX_POINTS)]

    def to_json(self, now: float) -> dict[str, Any]:
        summary = self.summary or {}
        projected = summary.get("projected") or {}
        return {
            "id": self.run_id,
            "kind": self.kind,
            "status": self.status,
            "started_at": self.started_at,
            "info": self.info,
            "nodes": [{**asdict(row), "silent_for": None if row.last_heard is None
                       else max(0.0, now - row.last_heard)} for row in self.nodes],
            "node_series": [asdict(s) for s in self.node_series if s.points],
            "mean_series": asdict(self.mean_series) if self.mean_series else None,
            "val_series": asdict(self.val_series) if self.val_series else None,
            "measured": self.measured,
            "projected": self.projected,
            "projected_total": projected.get("total_seconds"),
            "projected_cluster": projected.get("cluster"),
            "summary": summary,
            "events": self.events,
        }


class DashboardState:
    """Every run the dashboard shows; thread-safe (observers call from training threads,
    the server reads from its own). ``version`` grows with every change."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.runs: dict[str, RunState] = {}
        self.version = 0
        self._lock = threading.RLock()

    def _changed(self) -> None:
        self.version += 1

    def live_run(self, run_id: str, names: list[str], kind: str,
                 info: Mapping[str, Any] | None = None) -> LiveRun:
        """A run starting now, with one row per node name; feed it by registering the
        returned :class:`LiveRun` with :func:`meshtrain.observers.watching`."""
        with self._lock:
            run = RunState(run_id, names, kind=kind, clock=self.clock, changed=self._changed, info=info)
            self.runs[run_id] = run
            self._changed()
        return LiveRun(run, self._lock)

    def add_run_directory(self, run_dir: Path) -> RunState:
        """A finished run from its directory (raises :class:`RunDirError`)."""
        read = read_run_directory(run_dir)
        summary = read[0]
        nodes = min(summary["nodes"], MAX_NODES) if isinstance(summary.get("nodes"), int) else 0
        steps = summary.get("steps") if isinstance(summary.get("steps"), int) else None
        with self._lock:
            run_id = str(summary.get("run_id") or run_dir.name)
            if (run_dir.parent / "comparison.json").is_file():  # "compare-.../ddp", as `runs` names it
                run_id = f"{run_dir.parent.name}/{run_id}"
            while run_id in self.runs:  # two folders holding runs of one id
                run_id += "'"
            run = RunState(run_id, [f"node {r}" for r in range(nodes)], kind="finished", clock=self.clock,
                           changed=self._changed)
            run.load_directory(run_dir, read)
            shares = _balance_shares(summary, len(run.nodes))
            for row in run.nodes:
                row.state = DONE
                row.step = row.steps = steps
                row.batch_size = shares.get(row.rank)
            self.runs[run_id] = run
            return run

    def add_damaged_directory(self, run_dir: Path, problem: str) -> RunState:
        """A run directory that cannot be read (``problem``: the :class:`RunDirError` line),
        listed as damaged with the reason among its events, so the others are still shown."""
        with self._lock:
            run_id = run_dir.name
            while run_id in self.runs:
                run_id += "'"
            run = RunState(run_id, [], kind="finished", clock=self.clock, changed=self._changed,
                           info={"run_dir": str(run_dir)})
            run.status = DAMAGED
            run.event("failed", problem)
            self.runs[run_id] = run
            return run

    def snapshot(self) -> dict[str, Any]:
        """Everything, as JSON-ready data (non-finite numbers as None)."""
        with self._lock:
            now = self.clock()
            return _finite({"version": self.version, "now": now,
                            "runs": [run.to_json(now) for run in self.runs.values()]})


class LiveRun:
    """The :class:`~meshtrain.observers.RunObserver` of one live run: every call takes the
    dashboard's lock, then updates its :class:`RunState`."""

    def __init__(self, run: RunState, lock: threading.RLock) -> None:
        self.run = run
        self._lock = lock

    def node_started(self, node: int) -> None:
        with self._lock:
            self.run.node_started(node)

    def node_added(self, name: str) -> None:
        with self._lock:
            self.run.node_added(name)

    def node_update(self, update: NodeUpdate) -> None:
        with self._lock:
            self.run.node_update(update)

    def node_heard(self, node: int) -> None:
        with self._lock:
            self.run.node_heard(node)

    def node_ended(self, node: int, state: str, reason: str | None) -> None:
        with self._lock:
            self.run.node_ended(node, state, reason)

    def event(self, kind: str, text: str, node: int | None = None) -> None:
        with self._lock:
            self.run.event(kind, text, node)

    def run_finished(self, summary: Mapping[str, Any], history: list[dict[str, Any]]) -> None:
        with self._lock:
            self.run.run_finished(summary, history)

    def failed(self, message: str) -> None:
        with self._lock:
            self.run.failed(message)

    def ended(self) -> None:
        with self._lock:
            self.run.ended()

    def load_directory(self, run_dir: Path) -> bool:
        """Take the finished run's directory in; False (nothing changed) if it cannot be read:
        the run went well, only the dashboard shows less."""
        with self._lock:
            try:
                self.run.load_directory(run_dir)
            except RunDirError:
                return False
        return True


def _balance_shares(summary: Mapping[str, Any], nodes: int) -> dict[int, int]:
    """Each node's samples per step in a ``--balance`` run's summary (what is well formed)."""
    balance = summary.get("balance")
    entries = balance.get("nodes") if isinstance(balance, dict) else None
    shares: dict[int, int] = {}
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict):
            continue
        node, size = entry.get("node"), entry.get("batch_size")
        if _is_count(node) and _is_count(size) and node < nodes:
            shares[node] = size
    return shares


def _is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


#: The columns of metrics.csv the dashboard shows (every other one is dropped as it is read).
HISTORY_COLUMNS = ("step", "train_loss", "val_loss", "total_bytes_sent", "seconds", "projected_seconds")


def read_run_directory(run_dir: Path) -> RunFiles:
    """summary.json, config.yaml and metrics.csv of ``run_dir`` (config may be missing).

    A launched run's files came from its rank 0's host: the JSON and YAML are read within
    :mod:`meshtrain.yaml12`'s limits, and metrics.csv is streamed (only a regular file,
    opened non-blocking), keeping :data:`HISTORY_COLUMNS` as numbers, thinned to a few
    thousand rows: its memory does not grow with the file."""
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: no such run directory")
    summary_file, metrics_file = run_dir / "summary.json", run_dir / "metrics.csv"
    try:
        summary = yaml12.read_json(summary_file)
    except FileNotFoundError:
        raise RunDirError(f"{summary_file}: missing (not a finished run directory)") from None
    except (OSError, ValueError) as exc:  # a launched run's came from its rank 0's host
        problem = exc.strerror if isinstance(exc, OSError) else exc
        raise RunDirError(f"{summary_file}: unreadable ({problem})") from None
    if not isinstance(summary, dict):
        raise RunDirError(f"{summary_file}: expected a JSON object")
    config: dict[str, Any] = {}
    try:
        loaded = yaml12.read(run_dir / "config.yaml")
        config = loaded if isinstance(loaded, dict) else {}
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise RunDirError(f"{run_dir / 'config.yaml'}: unreadable ({exc})") from None
    except yaml12.YAMLError as exc:  # a launched run's came from its rank 0's host
        raise RunDirError(f"{run_dir / 'config.yaml'}: {yaml12.problem(exc)}") from None
    try:
        with yaml12.open_regular(metrics_file) as raw, \
                io.TextIOWrapper(raw, encoding="utf-8", newline="") as f:
            history = _thinned_history(csv.DictReader(f))
    except FileNotFoundError:
        raise RunDirError(f"{metrics_file}: missing (not a finished run directory)") from None
    except (OSError, csv.Error, UnicodeDecodeError, yaml12.Refused) as exc:
        raise RunDirError(f"{metrics_file}: unreadable ({exc})") from None
    return summary, config, history


def _thinned_history(rows: Iterator[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of metrics.csv, as :data:`HISTORY_COLUMNS` numbers, at most about
    2 x :data:`MAX_POINTS` training rows and as many validation rows (each list halved, and
    its stride doubled, whenever it overflows; the last row is always kept). Kept as tuples
    while reading: a dict per row would cost several times more."""
    kept: dict[bool, list[tuple[float | None, ...]]] = {False: [], True: []}  # by "has a val_loss"
    stride, seen = {False: 1, True: 1}, {False: 0, True: 0}
    last: tuple[float | None, ...] | None = None
    val = HISTORY_COLUMNS.index("val_loss")
    for row in rows:
        compact = tuple(_number(row.get(key)) for key in HISTORY_COLUMNS)
        is_val = compact[val] is not None
        if seen[is_val] % stride[is_val] == 0:
            kept[is_val].append(compact)
            if len(kept[is_val]) > 2 * MAX_POINTS:
                kept[is_val] = kept[is_val][::2]
                stride[is_val] *= 2
        seen[is_val] += 1
        last = compact
    both = kept[False] + kept[True]
    if last is not None and not any(row is last for row in both):
        both.append(last)
    both.sort(key=lambda row: row[0] if row[0] is not None else -1.0)  # HISTORY_COLUMNS[0]: step
    return [dict(zip(HISTORY_COLUMNS, row, strict=True)) for row in both]


def find_run_directories(path: Path) -> list[Path]:
    """``path`` itself if it is a run directory, else the run directories inside it and
    inside the comparison folders it holds (as ``meshtrain runs`` lists them)."""
    if (path / "summary.json").is_file():
        return [path]
    if not path.is_dir():
        raise RunDirError(f"{path}: no such run directory")
    found: list[Path] = []
    for child in sorted(p for p in path.iterdir() if p.is_dir()):
        if (child / "summary.json").is_file():
            found.append(child)
        elif (child / "comparison.json").is_file():  # meshtrain compare's folder of runs
            found += sorted(p for p in child.iterdir() if p.is_dir() and (p / "summary.json").is_file())
    if not found:
        raise RunDirError(f"{path}: holds no run directory (a folder with summary.json and metrics.csv)")
    return found


def _number(value: Any) -> float | None:
    if value is None or value == "" or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
