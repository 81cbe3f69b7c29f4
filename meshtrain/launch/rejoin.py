"""``launch --elastic``: the launcher's side of a rank that is lost and comes back.

When a rank other than 0 fails (killed, its host silent past the connection heartbeat, its
process silent past ``heartbeat_timeout``), the others are not stopped: they drop it at
their next sync (:mod:`meshtrain.comm.elastic`). The launcher retries the rank's host over
SSH from a thread, waiting 1 s, then twice as long each time up to ``rejoin_backoff``. When
the host answers, whatever is left of the rank's old process group is killed, a fresh copy
of the launch secret is delivered, and the rank is started again as a joiner
(``MESHTRAIN_JOINING=1``): it is admitted at the next outer sync and takes its state from a
peer. Rank 0 is not covered: it hosts the store, and its loss stops the run as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshtrain.hosts.ssh import Heartbeat, RemoteProcess, Shell, run, sh, shell_line

#: The first wait before a lost host is tried again (doubling up to ``rejoin_backoff``).
FIRST_RETRY_S = 1.0


@dataclass
class RankHistory:
    """What became of one slot in an elastic launch, for the result and the report."""

    rank: int
    host: str
    lost: list[str] = field(default_factory=list)  # why, each time it was lost
    rejoined: int = 0  # times it was started again


class Rejoiner:
    """Retries lost ranks' hosts and starts them again as joiners, one thread each.

    ``start_rank(rank_record, client)`` starts the rank's process on ``client`` (a fresh,
    authenticated connection) and returns (process, heartbeat); the launcher gives it, so
    the command is built where every rank's is."""

    def __init__(self, connect_host: Callable[[Any], Any], start_rank: Callable[[Any, Any], None],
                 note: Callable[[str], None], backoff: float,
                 reachable: Callable[[Any], None] = lambda host: None) -> None:
        self.connect_host = connect_host
        self.start_rank = start_rank
        #: Tells rank 0 that a lost rank's host answers again (it records the step).
        self.reachable = reachable
        self.note = note
        self.backoff = backoff
        self.stopping = threading.Event()
        self.history: dict[int, RankHistory] = {}
        self._threads: list[threading.Thread] = []

    def lost(self, rank_record: Any, reason: str) -> None:
        """``rank_record`` (the launcher's ``_Rank``) failed: try its host until it answers."""
        host = rank_record.host
        record = self.history.setdefault(host.rank, RankHistory(host.rank, host.name))
        record.lost.append(reason)
        self.note(f"rank {host.rank} on {host.name} {reason}; the others go on without it, and "
                  "it is tried again over SSH")
        thread = threading.Thread(target=self._retry, args=(rank_record, record), daemon=True,
                                  name=f"meshtrain-rejoin-{host.rank}")
        thread.start()
        self._threads.append(thread)

    def _retry(self, rank_record: Any, record: RankHistory) -> None:
        host = rank_record.host
        wait = FIRST_RETRY_S
        old_pgid = rank_record.process.pgid if rank_record.process is not None else None
        while not self.stopping.wait(wait):
            try:
                client = self.connect_host(host)
            except Exception:  # noqa: BLE001 - not back yet: try again later
                wait = min(self.backoff, wait * 2)
                continue
            try:
                self.reachable(host)
            except Exception:  # noqa: BLE001 - a record for the summary only: the rejoin goes on
                pass
            try:
                if old_pgid is not None:  # the rank's old process, if it survived the outage
                    run(client, sh(shell_line("kill", "-KILL", f"-{old_pgid}", Shell("2>/dev/null; true"))),
                        timeout=5.0)
                if self.stopping.is_set():
                    client.close()
                    return
                self.start_rank(rank_record, client)
            except Exception as exc:  # noqa: BLE001 - dropped again while starting: try again
                client.close()
                self.note(f"could not start rank {host.rank} on {host.name} again ({exc}); trying again")
                wait = min(self.backoff, wait * 2)
                continue
            record.rejoined += 1
            self.note(f"{host.name} answers again: rank {host.rank} started to rejoin at the next sync")
            return

    def stop(self) -> None:
        """The run is over: no more tries (a thread in the middle of one ends after it)."""
        self.stopping.set()


def restart_as_joiner(rank_record: Any, client: Any, command: str, on_line: Callable[[str], None],
                      watch: Callable[[Any], None]) -> None:
    """Start ``command`` (the rank's, as a joiner) on ``client`` and swap it into
    ``rank_record``: the old connection is closed, the outcome cleared last (the launch loop
    reads the process only while the outcome is None)."""
    process = RemoteProcess(client, command, on_line)
    heartbeat = Heartbeat(client)
    old_client, old_beat = rank_record.client, rank_record.heartbeat
    rank_record.client, rank_record.process, rank_record.heartbeat = client, process, heartbeat
    watch(process)
    rank_record.outcome = None
    if old_beat is not None:
        old_beat.stop()
    threading.Thread(target=old_client.close, daemon=True).start()  # a dead transport may linger


def wait_briefly(done: Callable[[], bool], seconds: float) -> bool:
    """Poll ``done`` for up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(0.05)
    return done()

