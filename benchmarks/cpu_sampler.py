"""CPU seconds per process and per thread of a launch, sampled from /proc (Linux).

Used by ``benchmarks/scaling.py --profile-cpu``. A background thread reads, every
``interval`` seconds, ``/proc/<pid>/stat`` and ``/proc/<pid>/task/<tid>/{stat,comm}`` of
every process below the given roots (the launcher, each host's sshd), and keeps each
thread's cumulative user + system time with the time it was read. Afterwards
:meth:`CpuSampler.window` gives the CPU seconds each (process kind, thread) used between
two monotonic times (interpolated between samples), so the training loop can be told
apart from start-up. Threads are told apart by their kernel name: :data:`THREAD_NAMER`,
loaded into the launcher and the ranks as ``sitecustomize``, names every Python thread
after itself (the kernel otherwise shows all of them under the interpreter's name).
A process that ends between two samples loses at most its last ``interval`` of CPU.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

TICK = os.sysconf("SC_CLK_TCK")

#: sitecustomize code: every Python thread sets its kernel name (15 bytes) from its own
#: name, "Thread-3 (one_way)" -> "one_way", "meshtrain-heartbeat" -> "heartbeat", an
#: unnamed thread without a target -> its class ("Transport").
THREAD_NAMER = """
import ctypes, threading
_libc = ctypes.CDLL(None, use_errno=True)
_start = threading.Thread._bootstrap_inner

def _named(self):
    name = self.name
    if name.endswith(")") and "(" in name:
        name = name[name.index("(") + 1:-1]
    elif name.startswith("Thread-"):  # no target: its class says more ("Transport")
        name = type(self).__name__
    name = name.removeprefix("meshtrain-")
    try:
        _libc.prctl(15, name.encode()[:15] + b"\\0", 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass
    _start(self)

threading.Thread._bootstrap_inner = _named
"""


def _stat_times(path: str) -> tuple[str, int, float] | None:
    """(comm, ppid, user + system seconds) from a /proc stat file; None if it is gone."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    comm = text[text.index("(") + 1:text.rindex(")")]
    rest = text[text.rindex(")") + 2:].split()
    return comm, int(rest[1]), (int(rest[11]) + int(rest[12])) / TICK


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class _Series:
    """One thread's (or one process's) cumulative CPU seconds over time."""

    kind: str  # "launcher", "host0 rank", "host1 sshd", ...
    thread: str
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def at(self, t: float) -> float:
        """Cumulative CPU seconds at ``t`` (linear between samples; 0 before the first)."""
        if not self.times or t <= self.times[0]:
            return 0.0 if not self.times or t < self.times[0] else self.cpu[0]
        if t >= self.times[-1]:
            return self.cpu[-1]
        i = bisect.bisect_right(self.times, t)
        t0, t1, c0, c1 = self.times[i - 1], self.times[i], self.cpu[i - 1], self.cpu[i]
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0)


class CpuSampler:
    """Samples the processes below ``roots`` (pid -> kind prefix) until :meth:`stop`."""

    def __init__(self, roots: dict[int, str], interval: float = 0.2) -> None:
        self.roots = roots
        self.interval = interval
        self.series: dict[tuple[int, int], _Series] = {}
        self.processes: dict[int, _Series] = {}  # whole process, exited threads included
        self._kinds: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)
        self.own_cpu = 0.0

    def start(self) -> CpuSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.thread_time()
            self._sample()
            self.own_cpu += time.thread_time() - started
            self._stop.wait(self.interval)

    def _kind(self, pid: int, parents: dict[int, int]) -> str | None:
        """The kind of ``pid`` if it is below a root: "launcher", or "<host> sshd|rank|other"."""
        if pid in self._kinds:
            return self._kinds[pid]
        chain, p = [], pid
        while p > 1 and p not in self.roots:
            chain.append(p)
            p = parents.get(p, 0)
        if p not in self.roots:
            return None
        prefix = self.roots[p]
        if prefix == "launcher":
            kind = "launcher" if pid == p else "launcher child"
        else:
            line = _cmdline(pid)
            kind = f"{prefix} " + ("sshd" if line.startswith("sshd") else
                                   "rank" if "meshtrain simulate" in line else "other")
        if not kind.endswith("other"):  # a shell may still exec into the rank: ask again
            self._kinds[pid] = kind
        return kind

    def _sample(self) -> None:
        parents: dict[int, int] = {}
        stats: dict[int, tuple[str, int, float]] = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                got = _stat_times(f"/proc/{name}/stat")
                if got is not None:
                    stats[int(name)] = got
                    parents[int(name)] = got[1]
        for pid in stats:
            kind = self._kind(pid, parents)
            if kind is None:
                continue
            # Read again with its time: the scan above may have begun before the pid was a root.
            got = _stat_times(f"/proc/{pid}/stat")
            if got is None:
                continue
            now = time.monotonic()
            whole = self.processes.setdefault(pid, _Series(kind, "(process)"))
            whole.kind = kind
            whole.times.append(now)
            whole.cpu.append(got[2])
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in map(int, tids):
                got = _stat_times(f"/proc/{pid}/task/{tid}/stat")
                if got is None:
                    continue
                label = "main" if tid == pid else got[0]
                s = self.series.setdefault((pid, tid), _Series(kind, label))
                s.kind, s.thread = kind, label
                s.times.append(time.monotonic())
                s.cpu.append(got[2])

    def window(self, start: float, end: float) -> dict[tuple[str, str], float]:
        """CPU seconds per (kind, thread) between monotonic ``start`` and ``end``; the CPU
        of threads that ended before the last sample is "(exited threads)"."""
        used: dict[tuple[str, str], float] = defaultdict(float)
        per_pid: dict[int, float] = defaultdict(float)
        for (pid, _), s in self.series.items():
            seconds = s.at(end) - s.at(start)
            used[(s.kind, s.thread)] += seconds
            per_pid[pid] += seconds
        for pid, s in self.processes.items():
            rest = (s.at(end) - s.at(start)) - per_pid[pid]
            if rest > 0.005:
                used[(s.kind, "(exited threads)")] += rest
        return dict(used)
