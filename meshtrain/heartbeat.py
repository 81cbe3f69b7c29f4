"""Liveness of launched ranks: each rank beats, the launcher notices one that stops.

A rank that is stopped (SIGSTOP, a laptop lid), deadlocked or stuck in a kernel leaves
its peers waiting in a collective until the rendezvous timeout (30 minutes by default),
and the rank that times out first is then blamed. Instead, ``meshtrain launch`` sets
MESHTRAIN_HEARTBEAT (seconds between beats) and MESHTRAIN_HEARTBEAT_FD in every rank's
environment; the rank runs a small thread that writes one byte, :data:`BEAT`, to that
descriptor every interval. The descriptor is the rank's output pipe, so the beats travel
over the SSH channel the launcher already reads; the launcher strips them out before
splitting lines (one byte written at once cannot tear a line apart, unlike a marker
line racing the program's own prints), remembers when it last heard each rank, and
stops the run naming a rank silent for ``heartbeat_timeout`` seconds.

A rank is held to this only after its first beat: a script that never starts the
heartbeat (one that does not use meshtrain in the rank) is not mistaken for a hung one.
Once its program is done, a rank says so with one :data:`FAREWELL` byte (an atexit
handler): the interpreter's own exit is silent (no thread runs while it tears down; with
torch loaded that takes about a second, longer on a loaded host), so from then on the
launcher waits up to :data:`EXIT_GRACE_S` rather than the heartbeat timeout.

Status messages for the live view ride on the same descriptor: see :class:`StatusReporter`.

Both ends of that channel live here, below ``launch/``: every launched rank (the trainer,
the launched runtime, the benchmark) beats and reports without importing the launcher.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BEAT = b"\x06"  # ASCII ACK: never part of text output, a single byte in UTF-8
FAREWELL = b"\x04"  # ASCII EOT: the program is done, the interpreter is exiting
EXIT_GRACE_S = 60.0  # the silence a rank that said farewell may keep before it counts as hung
HEARTBEAT_FD = 3  # the launcher's remote shell points this descriptor at the output pipe
_started: threading.Thread | None = None
_lock = threading.Lock()


def heartbeat_interval(timeout: float) -> float:
    """Seconds between beats for a ``timeout``: several beats fit in one timeout."""
    return max(0.1, min(5.0, timeout / 6))


def start_heartbeat() -> threading.Thread | None:
    """Start beating if this process is a rank of ``meshtrain launch``; idempotent.

    Returns the beating thread, or None where no launcher listens (torchrun, tests).
    """
    global _started
    try:
        interval = float(os.environ["MESHTRAIN_HEARTBEAT"])
        fd = int(os.environ["MESHTRAIN_HEARTBEAT_FD"])
    except (KeyError, ValueError):
        return None
    if not interval > 0:
        return None
    with _lock:
        if _started is None or not _started.is_alive():
            _started = threading.Thread(target=_beat, args=(fd, interval), name="meshtrain-heartbeat",
                                        daemon=True)
            _started.start()
            atexit.register(_farewell, fd)
        return _started


def _farewell(fd: int) -> None:
    try:
        os.write(fd, FAREWELL)
    except OSError:
        pass  # no launcher on the other end any more


def _beat(fd: int, interval: float) -> None:
    # A plain write to the descriptor, not sys.stdout: the program may have replaced
    # sys.stdout, and a beat must never wait on (or split) one of its prints.
    while True:
        try:
            os.write(fd, BEAT)
        except OSError:
            return  # no launcher on the other end (closed descriptor): stop quietly
        time.sleep(interval)


# --------------------------------------------------------------------------- status messages
STATUS_VERSION = 1
STATUS_OPEN = "\x02"  # ASCII STX: opens a status frame
STATUS_CLOSE = "\x03"  # ASCII ETX: closes it; a newline follows, so the launcher gets it at once
STATUS_MAX_BYTES = 512  # POSIX's smallest PIPE_BUF (macOS's): a write this size is never split
STATUS_INTERVAL = 0.5  # seconds: at most two statuses a second; slower steps send one each
_FRAME = re.compile(f"{STATUS_OPEN}(\\{{[^{STATUS_OPEN}{STATUS_CLOSE}\\n]*\\}}){STATUS_CLOSE}")


@dataclass(frozen=True)
class RankStatus:
    """Where one launched rank is: what it sends the launcher's live view.

    On the wire, version 1 is one compact JSON object between STX and ETX, then a newline:
    ``\\x02{"v":1,"step":12,"steps":20,"loss":0.53,"sps":8.1,"sent":1234,"rss":98765,
    "sync":10,"cpu":97.5,"gpu":123456,"batch":21}\\x03\\n``. Only ``v`` and ``step`` are
    required; a field the rank cannot know is left out (``sync`` where the strategy keeps
    no last-sync step, ``loss`` before the first step or when it is not finite, ``cpu``
    in the first status, ``gpu`` where torch holds no CUDA or MPS memory, ``batch`` in a
    run without ``balance``). A launcher that predates a field ignores it.
    """

    step: int  # steps done (0: the training loop is starting)
    steps: int | None = None  # the step budget
    loss: float | None = None  # this rank's loss at ``step``
    steps_per_second: float | None = None  # since its previous status
    bytes_sent: int | None = None  # everything its communicator sent, start-up included
    rss_bytes: int | None = None  # resident memory (the peak on macOS)
    last_sync: int | None = None  # the step after which it last synchronised with its peers
    cpu_percent: float | None = None  # process CPU time over wall time since its previous status
    gpu_bytes: int | None = None  # memory torch holds on its GPU (CUDA) or Apple GPU (MPS)
    batch_size: int | None = None  # its samples per step (its share under balance)

    def encode(self) -> bytes:
        """The frame for this status, to be written in one ``os.write``."""
        fields: dict[str, Any] = {"v": STATUS_VERSION, "step": self.step, "steps": self.steps,
                                  "loss": self.loss, "sps": self.steps_per_second,
                                  "sent": self.bytes_sent, "rss": self.rss_bytes, "sync": self.last_sync,
                                  "cpu": None if self.cpu_percent is None else round(self.cpu_percent, 1),
                                  "gpu": self.gpu_bytes, "batch": self.batch_size}
        payload = json.dumps({k: v for k, v in fields.items() if v is not None}, separators=(",", ":"),
                             allow_nan=False)
        frame = f"{STATUS_OPEN}{payload}{STATUS_CLOSE}\n".encode()
        assert len(frame) <= STATUS_MAX_BYTES, "a status frame must fit one atomic pipe write"
        return frame


def decode_status(payload: str) -> RankStatus | None:
    """The status in one frame's JSON ``payload``; None if it is not a version-1 status
    with well-typed fields (a newer rank's message, damage, or a hostile host's): it is
    then ignored. A frame longer than :data:`STATUS_MAX_BYTES`, NaN or Infinity, and
    numbers that no rank could send (beyond 2**63, negative counts) are refused."""
    if len(payload) > STATUS_MAX_BYTES:
        return None
    try:
        fields = json.loads(payload, parse_constant=_no_constant)
    except ValueError:
        return None
    if not isinstance(fields, dict) or fields.get("v") != STATUS_VERSION:
        return None

    def number(key: str, kind: type) -> Any:
        value = fields.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(key)
        if not abs(value) < 2**63:
            raise ValueError(key)
        if kind is int and (not float(value).is_integer() or value < 0):
            raise TypeError(key)
        return kind(value)

    try:
        step = number("step", int)
        if step is None:
            return None
        cpu = number("cpu", float)
        if cpu is not None and not cpu >= 0:
            return None
        return RankStatus(step, number("steps", int), number("loss", float), number("sps", float),
                          number("sent", int), number("rss", int), number("sync", int), cpu,
                          number("gpu", int), number("batch", int))
    except (TypeError, OverflowError, ValueError):
        return None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} in a status frame")


def split_status(line: str) -> tuple[str, list[RankStatus], bool]:
    """Take the status frames out of one output line.

    Returns the line's own text, the statuses in it, and whether the line ended with a
    frame. A frame ends with its own newline, so when one arrives while the program is
    in the middle of a line, the text before it is only the start of that line (its
    rest comes as the next line): the caller joins the two.
    """
    if STATUS_OPEN not in line:
        return line, [], False
    frames = list(_FRAME.finditer(line))
    statuses = [s for s in (decode_status(f.group(1)) for f in frames) if s is not None]
    ends_with_frame = bool(frames) and frames[-1].end() == len(line)
    return _FRAME.sub("", line), statuses, ends_with_frame


class StatusReporter:
    """Sends this rank's :class:`RankStatus` to the launcher's live view.

    Why the heartbeat descriptor and a framed message, not a marker line on stdout: the
    program's own output on that pipe is arbitrary text (a print without a newline, a
    progress bar redrawn with carriage returns, a user printing something that looks
    like a marker), so a marker line could be torn apart by a print in another thread
    or faked by the program. A frame is written with one ``os.write`` of at most
    :data:`STATUS_MAX_BYTES` (PIPE_BUF), so it reaches the pipe whole, between two of
    the program's writes; it is delimited by control characters (STX, ETX) that text
    output never holds, so the launcher finds it wherever it lands and never parses
    the program's text. It is JSON with a version field: never pickle, and a launcher
    ignores a version it does not know. The program could still write a frame itself:
    statuses only feed the live view, and the exit status travels in its own keyed frame
    (see :mod:`~meshtrain.hosts.host_output`).

    Statuses go out at most every ``interval`` seconds (each step when steps are slower),
    plus the announcement, the first step and the last, so they cost nothing next to a training step.
    """

    def __init__(self, fd: int, steps: int, *, interval: float = STATUS_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fd = fd
        self.steps = steps
        self.interval = interval
        self.clock = clock
        self._sent_at: float | None = None
        self._sent_step = 0
        self._stepped = False  # the first step's status always goes, even right after announce()
        self._cpu_at = time.process_time()  # CPU use is measured between two statuses
        #: This rank's samples per step, sent with every status (the loop sets it under balance).
        self.batch_size: int | None = None

    def step_done(self, step: int, loss: float | None, bytes_sent: int, strategy: Any = None, *,
                  final: bool = False) -> bool:
        """Report ``step`` steps done, if one is due (always for the first and ``final``).

        Returns whether a status was sent. ``strategy`` gives the last sync step where it
        keeps one (see :func:`last_sync_step`).
        """
        now = self.clock()
        due = self._sent_at is None or now - self._sent_at >= self.interval
        if self._stepped and not final and not due:
            return False
        self._stepped = True
        return self._send(step, loss, bytes_sent, strategy, now)

    def _send(self, step: int, loss: float | None, bytes_sent: int, strategy: Any, now: float) -> bool:
        if self.fd < 0:
            return False  # nobody listens any more
        rate = cpu = None
        cpu_now = time.process_time()
        if self._sent_at is not None and now > self._sent_at:
            cpu = max(0.0, 100.0 * (cpu_now - self._cpu_at) / (now - self._sent_at))
            if step > self._sent_step:
                rate = (step - self._sent_step) / (now - self._sent_at)
        status = RankStatus(
            step, self.steps, loss if loss is not None and math.isfinite(loss) else None, rate,
            bytes_sent, resident_bytes(), last_sync_step(strategy) if strategy is not None else None,
            cpu, accelerator_bytes(), self.batch_size)
        try:
            os.write(self.fd, status.encode())
        except OSError:
            self.fd = -1  # nobody listens any more: stop trying, quietly (training goes on)
            return False
        self._sent_at, self._sent_step, self._cpu_at = now, step, cpu_now
        return True

    def announce(self, first_step: int) -> None:
        """Say the rank is up at ``first_step`` (no step done yet): the live view shows it
        before the first step, which is still sent however soon it follows."""
        self._send(first_step, None, 0, None, self.clock())


def status_reporter(steps: int, first_step: int = 0) -> StatusReporter | None:
    """A reporter that has announced ``first_step``, if ``meshtrain launch`` started this
    rank (its heartbeat descriptor is set); None elsewhere (torchrun, simulations)."""
    try:
        fd = int(os.environ["MESHTRAIN_HEARTBEAT_FD"])
        float(os.environ["MESHTRAIN_HEARTBEAT"])
    except (KeyError, ValueError):
        return None
    reporter = StatusReporter(fd, steps)
    reporter.announce(first_step)
    return reporter


def last_sync_step(strategy: Any) -> int | None:
    """Steps done when ``strategy`` last synchronised the nodes (part of the strategy
    contract, :meth:`~meshtrain.strategies.Strategy.last_synced`), or None before the first
    sync and for an object that is no strategy."""
    answer = getattr(strategy, "last_synced", None)
    done = answer() if callable(answer) else None
    return done if isinstance(done, int) and not isinstance(done, bool) else None


def resident_bytes() -> int | None:
    """This process's resident memory: current on Linux, the peak on macOS; None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def accelerator_bytes() -> int | None:
    """Memory torch holds on this process's GPU (CUDA) or Apple GPU (MPS); None where it uses
    neither (or torch is not loaded: this module never imports it)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if torch.cuda.is_initialized():
            return int(torch.cuda.memory_allocated())
        mps = getattr(torch, "mps", None)
        if mps is not None and torch.backends.mps.is_available():
            held = int(mps.current_allocated_memory())
            return held if held > 0 else None
    except (RuntimeError, AttributeError):  # a build without the backend
        return None
    return None
