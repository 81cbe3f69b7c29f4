"""All nodes in this process, one thread each: one torch import, one copy of the data.

torch releases the GIL inside its kernels, so node threads overlap their compute, up to
the run's ``concurrent_nodes`` at a time (default: the cores this process may use divided by
``threads``): more runnable node threads than that only trade the interpreter lock back and
forth (see :class:`~meshtrain.comm.threads.ThreadHub`'s run slots).
Kernels run with the run's ``threads`` setting (1 by default: no oversubscription, and
results that match the processes runtime, or launched ranks, at the same count bit for
bit). Each node keeps its own random stream: forward passes take turns on torch's global
generators (the CPU's, and the GPU's on cuda or mps), holding that node's state.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections.abc import Callable, Iterator

import torch

from meshtrain import seeding
from meshtrain.comm import NodeAborted, ThreadCommunicator, ThreadHub
from meshtrain.config.environment import usable_cores
from meshtrain.devices import resolve_device
from meshtrain.engine.job import FitResult, NodeFailed, NodeJob
from meshtrain.engine.loop import node_seed, train_node

#: Seconds the other nodes get to stop after one failed, before fit raises anyway.
ABORT_GRACE_S = 5.0


class _SharedGenerator:
    """Gives one node at a time torch's global generators, holding that node's stream.

    Threads share one global generator; swapping each node's state in and out makes
    dropout masks reproducible and identical to a process that seeded its own. A node
    waiting for its turn still notices a failed peer, and gives up after the run's
    collective timeout (a peer hung inside its forward pass holds the generator).
    """

    def __init__(self, hub: ThreadHub) -> None:
        self.lock = threading.Lock()
        self.hub = hub
        self.holder: int | None = None

    def guard_for(self, seed: int, rank: int,
                  device: torch.device) -> Callable[[], contextlib.AbstractContextManager[None]]:
        # On a GPU dropout draws from that GPU's generator: the node's stream holds both.
        stream = [seeding.seeded_state(seed, device)]

        @contextlib.contextmanager
        def guard() -> Iterator[None]:
            self._acquire(rank)
            try:
                # A node left behind by a failed fit (fit waits for it only a grace period)
                # stops here: it must not swap its stream into the global generator, which
                # this process's next fit, or the caller, may be using by then.
                self.hub.check()
                self.holder = rank
                seeding.restore_state(stream[0], device)
                try:
                    yield
                finally:
                    stream[0] = seeding.current_state(device)
            finally:
                self.holder = None
                self.lock.release()

        return guard

    def _acquire(self, rank: int) -> None:
        timeout_s = self.hub.timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.lock.acquire(timeout=0.05):
            self.hub.check()
            if deadline is not None and time.monotonic() >= deadline:
                busy = self.holder
                raise TimeoutError(f"node {rank} waited more than {timeout_s:g} s for nodes "
                                   f"[{busy}] (busy in a forward pass)")


def run_threads(job: NodeJob) -> FitResult:
    """Train every node of ``job`` in its own thread; raise :class:`NodeFailed` on error.

    Every node thread has ended when this returns or raises (one hung outside torch for
    longer than :data:`ABORT_GRACE_S` after a failure is the exception): a thread still
    inside torch when the interpreter exits aborts the process.
    """
    n = job.config.nodes
    hub = ThreadHub(n, timeout_s=job.config.timeout_s, slots=concurrent_nodes(job))
    results: dict[int, FitResult] = {}
    errors: dict[int, tuple[BaseException, str]] = {}
    # Every node gets its own random stream, whether or not the model's randomness is
    # visible (F.dropout, attention dropout): forward passes take turns on the generator.
    shared = _SharedGenerator(hub)
    device = resolve_device(job.config.device)

    # Each node says when it has ended: after a Ctrl-C, Thread.join cannot be trusted (in
    # Python 3.11 a join interrupted by the KeyboardInterrupt marks the thread it waited for
    # as stopped while it still runs, and a later join returns at once).
    ended = [threading.Event() for _ in range(n)]

    def node_main(rank: int) -> None:
        comm = ThreadCommunicator(hub, rank)
        try:
            hub.take_slot(rank)
            # A thread that came up only after a Ctrl-C interrupted its start() has no ident
            # when the interrupted fit picks the threads to wait for: it must not begin
            # training (a thread inside torch when the interpreter exits aborts the process).
            hub.check()
            guard = shared.guard_for(node_seed(job.config.seed, rank), rank, device)
            results[rank] = train_node(job, comm, rng_guard=guard)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            errors[rank] = (exc, traceback.format_exc())
            hub.abort(exc)
        finally:
            hub.give_slot(rank)
            ended[rank].set()

    threads_before = torch.get_num_threads()
    torch.set_num_threads(job.config.threads or 1)
    threads = [
        threading.Thread(target=node_main, args=(r,), name=f"meshtrain-node-{r}", daemon=True)
        for r in range(n)
    ]
    try:
        try:
            # Inside the try: under load start() waits a while for each new thread, and a
            # Ctrl-C then must stop the nodes already started too (a thread still inside
            # torch when the interpreter exits aborts the process).
            for t in threads:
                t.start()
            for done in ended:
                while not errors and not done.wait(timeout=0.1):
                    pass  # a failed node ends the wait: the others are stopped below
        except BaseException as interrupt:  # Ctrl-C: stop every node before leaving
            hub.abort(interrupt)
            _within_grace([ended[r].wait for r, t in enumerate(threads) if t.ident is not None])
            raise
        if errors:
            # The others stop at their next collective, step or validation batch; one stuck
            # outside torch (a hung data loader, a sleep) is left behind rather than hanging fit.
            _within_grace([done.wait for done in ended])
        # A node sets its event before its thread lets go of what it held (its communicator,
        # buffers): join, so no thread still frees tensors when the caller's interpreter exits
        # (a thread in torch then aborts the process: "terminate called without an active
        # exception").
        _within_grace([t.join for r, t in enumerate(threads) if ended[r].is_set()])
    finally:
        torch.set_num_threads(threads_before)
    real = {r: e for r, e in errors.items() if not isinstance(e[0], NodeAborted)}
    if real or errors:
        rank = min(real or errors)
        exc, text = (real or errors)[rank]
        raise NodeFailed(rank, f"{type(exc).__name__}: {exc}", text) from exc
    return results[0]


def concurrent_nodes(job: NodeJob) -> int:
    """How many node threads compute at once: the run's setting, else the cores this
    process may use divided by each node's intra-op threads."""
    if job.config.concurrent_nodes is not None:
        return job.config.concurrent_nodes
    return max(1, usable_cores() // (job.config.threads or 1))


def _within_grace(waits: list[Callable[[float], object]]) -> None:
    """Call each ``wait(timeout)`` (an event's wait, a thread's join) in turn, all of them
    within one :data:`ABORT_GRACE_S`."""
    grace = time.monotonic() + ABORT_GRACE_S
    for wait in waits:
        wait(max(0.0, grace - time.monotonic()))
