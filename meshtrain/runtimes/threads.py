"""All nodes in this process, one thread each: one torch import, one copy of the data.

torch releases the GIL inside its kernels, so node threads overlap their compute.
Each node runs single-threaded kernels (no oversubscription, and results that match
the one-thread-per-process runtime bit for bit).
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections.abc import Callable, Iterator

import torch
from torch import nn

from meshtrain.comm import NodeAborted, ThreadCommunicator, ThreadHub
from meshtrain.trainer import FitResult, NodeFailed, NodeJob, node_seed, train_node

#: Seconds the other nodes get to stop after one failed, before fit raises anyway.
ABORT_GRACE_S = 5.0


def is_stochastic(model: nn.Module) -> bool:
    """Whether the forward pass draws random numbers (dropout with p > 0)."""
    return any(
        isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()
    )


class _SharedGenerator:
    """Gives one node at a time torch's global CPU generator, holding that node's stream.

    Threads share one global generator; swapping each node's state in and out makes
    dropout masks reproducible and identical to a process that seeded its own.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def guard_for(self, seed: int) -> Callable[[], contextlib.AbstractContextManager[None]]:
        state = torch.Generator().manual_seed(seed).get_state()
        holder = [state]

        @contextlib.contextmanager
        def guard() -> Iterator[None]:
            with self.lock:
                torch.set_rng_state(holder[0])
                try:
                    yield
                finally:
                    holder[0] = torch.get_rng_state()

        return guard


def run_threads(job: NodeJob) -> FitResult:
    """Train every node of ``job`` in its own thread; raise :class:`NodeFailed` on error."""
    n = job.config.nodes
    hub = ThreadHub(n, timeout_s=job.config.timeout_s)
    results: dict[int, FitResult] = {}
    errors: dict[int, tuple[BaseException, str]] = {}
    shared = _SharedGenerator() if is_stochastic(job.model) else None

    def node_main(rank: int) -> None:
        comm = ThreadCommunicator(hub, rank)
        try:
            guard = shared.guard_for(node_seed(job.config.seed, rank)) if shared else None
            results[rank] = train_node(job, comm, rng_guard=guard)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            errors[rank] = (exc, traceback.format_exc())
            hub.abort(exc)

    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        threads = [
            threading.Thread(target=node_main, args=(r,), name=f"meshtrain-node-{r}", daemon=True)
            for r in range(n)
        ]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive() and not errors:
                t.join(timeout=0.1)
        if errors:
            # The others stop at their next collective; one stuck outside any collective
            # (a hung forward pass) is left behind as a daemon rather than hanging fit.
            grace = time.monotonic() + ABORT_GRACE_S
            for t in threads:
                t.join(timeout=max(0.0, grace - time.monotonic()))
    finally:
        torch.set_num_threads(threads_before)
    real = {r: e for r, e in errors.items() if not isinstance(e[0], NodeAborted)}
    if real:
        rank = min(real)
        exc, _ = real[rank]
        raise NodeFailed(rank, f"{type(exc).__name__}: {exc}") from exc
    if errors:
        rank = min(errors)
        raise NodeFailed(rank, str(errors[rank][0])) from errors[rank][0]
    return results[0]
