"""In-process collectives: every node is a thread and tensors never leave memory.

Each collective is a *round* keyed by (group, sequence number). Members deposit
their tensor; the last to arrive computes the result once (in the ring's summation
order) and wakes the others. If any node fails, :meth:`ThreadHub.abort` wakes every
waiter with :class:`NodeAborted`, so one failure never hangs the rest; a node that
waits longer than ``timeout_s`` for its peers raises :class:`TimeoutError`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from meshtrain.comm.communicator import Communicator, NodeAborted, ReduceOp, ring_reduce


@dataclass
class _Round:
    expected: int
    payloads: dict[int, Any] = field(default_factory=dict)
    result: Any = None
    done: bool = False


class ThreadHub:
    """Shared meeting point of the threads of one simulated cluster."""

    def __init__(self, world_size: int, timeout_s: float | None = None) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._cv = threading.Condition()
        self._rounds: dict[tuple[tuple[int, ...], int], _Round] = {}
        self._error: BaseException | None = None

    def abort(self, error: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = error
            self._cv.notify_all()

    def exchange(
        self,
        key: tuple[tuple[int, ...], int],
        rank: int,
        payload: Any,
        combine: Callable[[list[Any]], Any],
    ) -> Any:
        """Deposit ``payload``; return ``combine(payloads in member order)``, computed once."""
        members = key[0]
        with self._cv:
            self._check()
            rnd = self._rounds.setdefault(key, _Round(expected=len(members)))
            rnd.payloads[rank] = payload
            last = len(rnd.payloads) == rnd.expected
            if last:
                del self._rounds[key]
        if last:
            # Computed outside the lock so other groups (islands) proceed in parallel.
            try:
                result = combine([rnd.payloads[m] for m in members])
            except BaseException as exc:
                self.abort(exc)
                raise
            with self._cv:
                rnd.result, rnd.done = result, True
                self._cv.notify_all()
            return result
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        with self._cv:
            while not rnd.done:
                self._check()
                if deadline is not None and time.monotonic() >= deadline:
                    missing = sorted(set(members) - set(rnd.payloads))
                    raise TimeoutError(
                        f"collective waited more than {self.timeout_s:g} s for nodes {missing}"
                    )
                wait = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
                self._cv.wait(timeout=wait)
            return rnd.result

    def check(self) -> None:
        """Raise :class:`NodeAborted` if a node of this cluster has failed."""
        with self._cv:
            self._check()

    def _check(self) -> None:
        if self._error is not None:
            raise NodeAborted(f"stopping: another node failed ({self._error!r})")


class ThreadCommunicator(Communicator):
    """A node's view of a :class:`ThreadHub`."""

    def __init__(self, hub: ThreadHub, rank: int) -> None:
        super().__init__(rank, hub.world_size)
        self.hub = hub
        self._sequence: dict[tuple[int, ...], int] = {}

    def _key(self, members: list[int]) -> tuple[tuple[int, ...], int]:
        group = tuple(members)
        seq = self._sequence.get(group, 0)
        self._sequence[group] = seq + 1
        return group, seq

    def _ring_all_reduce(self, flat: torch.Tensor, op: ReduceOp, members: list[int]) -> torch.Tensor:
        result = self.hub.exchange(
            self._key(members), self.rank, flat, lambda xs: ring_reduce(xs, op)
        )
        return result

    def _all_gather(self, flat: torch.Tensor, members: list[int]) -> list[torch.Tensor]:
        # The depositor may change its tensor once it returns: the result holds copies.
        result = self.hub.exchange(
            self._key(members), self.rank, flat, lambda xs: [x.clone() for x in xs]
        )
        return list(result)

    def _broadcast(self, flat: torch.Tensor, src: int, members: list[int]) -> torch.Tensor:
        index = members.index(src)
        return self.hub.exchange(
            self._key(members), self.rank, flat, lambda xs: xs[index].clone()
        )


    def abort(self, error: BaseException) -> None:
        self.hub.abort(error)

    def check_abort(self) -> None:
        self.hub.check()
