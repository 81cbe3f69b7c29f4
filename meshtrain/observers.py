"""Watching runs as they happen: the small interface the live dashboard is fed through.

The trainer (simulated nodes) and the launcher's output (launched ranks) tell every
observer registered in this process what happens: a node starts, reports where it is,
is heard from, stops; events worth a line (a node left, a step skipped for a non-finite
loss, a restart); the run's summary at the end. The library only knows this interface;
:mod:`meshtrain.dashboard` implements it, and the CLI registers it with :func:`watching`.

Observers are called from training threads: they must be quick and never raise into the
run (a failing observer is dropped, never the run's error).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from meshtrain.heartbeat import RankStatus, accelerator_bytes, resident_bytes


@dataclass(frozen=True)
class NodeUpdate:
    """Where one node (a simulated node or a launched rank) is; None: not known."""

    node: int
    step: int  # steps done
    steps: int | None = None  # the step budget
    loss: float | None = None  # this node's loss at ``step`` (None when not finite)
    steps_per_second: float | None = None
    bytes_sent: int | None = None  # everything it sent so far
    rss_bytes: int | None = None  # resident memory of its process
    cpu_percent: float | None = None  # CPU time over wall time since its previous update
    last_sync: int | None = None  # the step after which it last synchronised
    gpu_bytes: int | None = None  # memory torch holds on its GPU (CUDA) or Apple GPU (MPS)
    batch_size: int | None = None  # its samples per step (its share under balance)

    @classmethod
    def from_status(cls, rank: int, status: RankStatus) -> NodeUpdate:
        """The update a launched rank's status frame carries."""
        return cls(rank, status.step, status.steps, status.loss, status.steps_per_second,
                   status.bytes_sent, status.rss_bytes, status.cpu_percent, status.last_sync,
                   status.gpu_bytes, status.batch_size)


STARTING, TRAINING, FINISHING = "starting", "training", "finishing"
#: The figures a :class:`NodeUpdate` carries that a row keeps (its step aside).
FIGURES = ("steps", "loss", "steps_per_second", "bytes_sent", "rss_bytes", "cpu_percent",
           "gpu_bytes", "batch_size", "last_sync")


@dataclass
class NodeRow:
    """What a view knows about one node: a launched host's rank or a simulated node. The one
    row definition of the launch's live panel (launch/live.py) and the web dashboard."""

    name: str  # the host's name, or "node N"
    rank: int
    state: str = STARTING
    step: int | None = None
    steps: int | None = None
    loss: float | None = None
    steps_per_second: float | None = None
    bytes_sent: int | None = None
    rss_bytes: int | None = None
    cpu_percent: float | None = None
    gpu_bytes: int | None = None
    batch_size: int | None = None
    last_sync: int | None = None
    last_heard: float | None = None  # when it was last heard (the view's clock)
    ended_at: float | None = None  # when it stopped (the live panel's clock)
    reason: str | None = None  # why it failed or was lost
    restarts: int = 0

    def silent_for(self, now: float) -> float | None:
        """Seconds since it was last heard (frozen once it stopped); None if never."""
        if self.last_heard is None:
            return None
        return max(0.0, (self.ended_at if self.ended_at is not None else now) - self.last_heard)

    def take(self, update: NodeUpdate) -> None:
        """Fold in ``update``: a figure it leaves out keeps its last value; past the last
        step the node is finishing (final evaluation, writing the run directory)."""
        self.step = update.step
        for name in FIGURES:
            value = getattr(update, name)
            if value is not None:
                setattr(self, name, value)
        self.state = FINISHING if self.steps is not None and update.step >= self.steps else TRAINING


class RunObserver(Protocol):
    """What a run tells its observers. ``node`` is a rank (0-based)."""

    def node_started(self, node: int) -> None:
        """The node started (again, after a restart)."""

    def node_added(self, name: str) -> None:
        """A host joined the running launch (``meshtrain hosts add``): the next node."""

    def node_update(self, update: NodeUpdate) -> None:
        """The node reports where it is."""

    def node_heard(self, node: int) -> None:
        """The node said something (a line of output): it is alive."""

    def node_ended(self, node: int, state: str, reason: str | None) -> None:
        """The node stopped: ``state`` is done, failed, lost or stopped; ``reason`` why."""

    def event(self, kind: str, text: str, node: int | None = None) -> None:
        """Something worth a line: ``kind`` is restart, lost, failed, nonfinite, left or note."""

    def run_finished(self, summary: Mapping[str, Any], history: list[dict[str, Any]]) -> None:
        """The run ended well: summary.json's content and metrics.csv's rows (rank 0)."""


_observers: list[RunObserver] = []
_lock = threading.Lock()


@contextmanager
def watching(observer: RunObserver) -> Iterator[RunObserver]:
    """Tell ``observer`` about the runs in this process while inside the block."""
    with _lock:
        _observers.append(observer)
    try:
        yield observer
    finally:
        with _lock:
            if observer in _observers:
                _observers.remove(observer)


def active() -> bool:
    """Whether anyone watches (the trainer skips collecting what nobody reads)."""
    return bool(_observers)


def notify(method: str, *args: Any) -> None:
    """Call ``method`` on every observer; one that raises is dropped, the run goes on."""
    if not _observers:  # nobody watches (the usual case): no lock taken per line or step
        return
    with _lock:
        current = list(_observers)
    for observer in current:
        try:
            getattr(observer, method)(*args)
        except Exception:  # noqa: BLE001 - a broken dashboard must never stop training
            with _lock:
                if observer in _observers:
                    _observers.remove(observer)


class NodeReporter:
    """Sends one node's :class:`NodeUpdate` at most every ``interval`` seconds (plus the
    first step and the last), with its rate and CPU use since the previous one.

    ``own_thread``: the node is a thread sharing this process (the threads runtime), so its
    CPU use is this thread's CPU time; otherwise the whole process's.
    """

    def __init__(self, node: int, steps: int, *, own_thread: bool, interval: float = 0.25) -> None:
        self.node, self.steps, self.interval = node, steps, interval
        self._cpu_clock = time.thread_time if own_thread else time.process_time
        self._sent_at: float | None = None
        self._sent_step = 0
        self._cpu_at = self._cpu_clock()
        #: The node's samples per step, sent with every update (the loop sets it under balance).
        self.batch_size: int | None = None
        notify("node_started", node)

    def step_done(self, step: int, loss: float | None, bytes_sent: int, *, final: bool = False) -> None:
        now = time.monotonic()
        if self._sent_at is not None and not final and now - self._sent_at < self.interval:
            return
        rate = cpu = None
        cpu_now = self._cpu_clock()
        if self._sent_at is not None and now > self._sent_at:
            rate = (step - self._sent_step) / (now - self._sent_at)
            cpu = 100.0 * (cpu_now - self._cpu_at) / (now - self._sent_at)
        finite = loss is not None and math.isfinite(loss)
        notify("node_update", NodeUpdate(self.node, step, self.steps, loss if finite else None, rate,
                                         bytes_sent, resident_bytes(), cpu, None, accelerator_bytes(),
                                         self.batch_size))
        self._sent_at, self._sent_step, self._cpu_at = now, step, cpu_now


class QueueForwarder:
    """An observer inside a node process (the processes runtime): it puts every call on the
    ``results`` queue its parent reads, as ``(node, "observe", (method, args))``; the parent
    hands them to its own observers (:func:`notify`). A local multiprocessing queue between
    this machine's own processes, never the network."""

    def __init__(self, results: Any, node: int) -> None:
        self.results = results
        self.node = node

    def _put(self, method: str, *args: Any) -> None:
        self.results.put((self.node, "observe", (method, args)))

    def node_started(self, node: int) -> None:
        self._put("node_started", node)

    def node_added(self, name: str) -> None:
        self._put("node_added", name)

    def node_update(self, update: NodeUpdate) -> None:
        self._put("node_update", update)

    def node_heard(self, node: int) -> None:
        self._put("node_heard", node)

    def node_ended(self, node: int, state: str, reason: str | None) -> None:
        self._put("node_ended", node, state, reason)

    def event(self, kind: str, text: str, node: int | None = None) -> None:
        self._put("event", kind, text, node)

    def run_finished(self, summary: Mapping[str, Any], history: list[dict[str, Any]]) -> None:
        self._put("run_finished", dict(summary), history)
