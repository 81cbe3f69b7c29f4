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
"""

from __future__ import annotations

import os
import threading
import time

BEAT = b"\x06"  # ASCII ACK: never part of text output, a single byte in UTF-8
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
        return _started


def _beat(fd: int, interval: float) -> None:
    # A plain write to the descriptor, not sys.stdout: the program may have replaced
    # sys.stdout, and a beat must never wait on (or split) one of its prints.
    while True:
        try:
            os.write(fd, BEAT)
        except OSError:
            return  # no launcher on the other end (closed descriptor): stop quietly
        time.sleep(interval)
