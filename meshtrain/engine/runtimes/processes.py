"""One process per node, torch.distributed over gloo (nccl for CUDA) on loopback.

This is the code path real hosts use, run locally: the parent spawns the nodes,
watches them, and stops them all as soon as one fails, so no node waits forever on
a peer that is gone.
"""

from __future__ import annotations

import copy
import io
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from meshtrain import observers
from meshtrain.comm.torch_dist import host_loopback_store, loopback_interface
from meshtrain.devices import resolve_device
from meshtrain.engine.job import FitResult, NodeFailed, NodeJob
from meshtrain.engine.runtimes.launched import join_and_train

POLL_SECONDS = 0.2
FAILURE_GRACE_S = 1.0  # how long to wait for the other nodes' reports after a failure


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every node imports anyway: meshtrain (first: it sets the server to ignore Ctrl-C before
# the slow imports, meshtrain/interrupts.py) with torch, torch._dynamo (the optimizers load
# it at their first step) and matplotlib with its Agg renderer (rank 0 draws loss.png).
PRELOAD = ["meshtrain", "torch", "torch._dynamo", "meshtrain.engine.runtimes.launched",
           "matplotlib.figure", "matplotlib.backends.backend_agg"]


def node_context() -> Any:
    """The multiprocessing context that starts node processes.

    On Linux a forkserver that has imported :data:`PRELOAD` once: each node forks from it
    in milliseconds instead of importing torch again (~2.4 s per process on 2 cores). A
    node still gets a fresh interpreter state, never a copy of the caller's (like spawn).
    Elsewhere spawn: macOS forbids forking a process that may have started system
    frameworks, and Windows cannot fork.
    """
    if sys.platform.startswith("linux") and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return mp.get_context("spawn")


def callers_cores() -> list[int] | None:
    """The cores the calling thread may run on (``taskset`` included); None off Linux."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def bind_to_cores(rank: int, nodes: int, threads: int, cores: list[int] | None) -> set[int] | None:
    """Bind the calling node process (the threads it starts from now on included: gloo's,
    the gradient buckets' worker) to ``threads`` of ``cores`` (the caller's), round-robin
    by rank: node r gets the cores from r * threads on, wrapping round. Returns them, or
    None where the node is not bound to its own (it then runs on all of ``cores``, as a
    process the caller spawned would: the fork server's may be older).

    Only a run that fills the cores is bound: ``nodes * threads`` at least as many as there
    are cores, and fewer than all for each node. There the nodes' ring waits on each other
    every step and loses to migration: with 4 nodes on 2 cores, unbound, a node woken by its
    peer's message waits for whichever core the scheduler last put it on; bound
    round-robin (as MPI binds ranks to cores), ring neighbours sit on different cores, and
    the DDP benchmark (``benchmarks/runtimes.py``) took 1.8-2.1 s instead of 2.2-2.4 s. A
    run with cores to spare is left to the scheduler: two such runs side by side would
    otherwise both crowd onto the first cores."""
    if cores is None:  # not Linux: no binding
        return None
    if threads >= len(cores) or nodes * threads < len(cores):
        os.sched_setaffinity(0, cores)
        return None
    mine = {cores[(rank * threads + i) % len(cores)] for i in range(threads)}
    os.sched_setaffinity(0, mine)
    return mine


def _node_process(job: NodeJob, rank: int, port: int, results: Any, observed: bool = False,
                  environ: dict[str, str] | None = None, cores: list[int] | None = None) -> None:
    # The run that started this node stops it (_stop); a terminal's Ctrl-C, which reaches
    # every process of its group, is the parent's to answer. (Forked from the node server,
    # a node ignores it from its start already; spawned, from here.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if environ is not None:
        # The forkserver's environment is the caller's as it was when the server started:
        # the node takes the caller's environment of now, as a spawned process would.
        os.environ.clear()
        os.environ.update(environ)
    torch.set_num_threads(job.config.threads or 1)  # N processes share the cores: 1 each by default
    device = resolve_device(job.config.device)
    if device.type == "cpu":
        bind_to_cores(rank, job.config.nodes, job.config.threads or 1, cores)
    if device.type == "cuda":
        # Node N on GPU N (the fit checked there are enough: nccl refuses two ranks on one);
        # device "cuda" means the current GPU to torch and nccl alike.
        torch.cuda.set_device(rank)
    loopback = loopback_interface()
    if loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback  # gloo listens on loopback only
    reported = False

    def report(exc: BaseException) -> None:
        nonlocal reported
        # With the time it failed: the parent blames the node whose error came first.
        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        results.put((rank, "error", (time.monotonic(), text)))
        reported = True

    try:
        # The parent's observers (a live dashboard) hear this node through the results queue.
        with observers.watching(observers.QueueForwarder(results, rank)) if observed else nullcontext():
            result = join_and_train(job, rank, job.config.nodes, "127.0.0.1", port,
                                    job.config.timeout_s, verify_replicas=False, external_store=True,
                                    on_failure=report)
        payload = None
        if rank == 0:
            payload = {
                # Bytes, not tensors: torch would share tensors through file descriptors
                # that vanish when this process exits.
                "state_dict": _to_bytes(result.model.state_dict()),
                "history": result.history,
                "run_dir": result.run_dir,
                "summary": result.summary,
            }
        results.put((rank, "done", payload))
    except BaseException as exc:  # noqa: BLE001 - sent to the parent
        if not reported:
            report(exc)
        raise SystemExit(1) from None


@contextmanager
def _ctrl_c_deferred() -> Iterator[None]:
    """Hold a Ctrl-C until the block ends. Inside ``Process.start`` it could land after the
    node server forked a node but before the start learnt its pid: that node was never
    stopped, and once this process exited it printed a traceback (its queue was gone)."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield  # only the main thread sets handlers; None: one Python did not set, not restorable
        return
    arrived: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: arrived.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if arrived and callable(previous):
        previous(signal.SIGINT, None)  # Python's own handler raises KeyboardInterrupt here
    elif arrived and previous == signal.SIG_DFL:
        signal.raise_signal(signal.SIGINT)  # the caller chose to die of it


def _to_bytes(state: dict[str, torch.Tensor]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def run_processes(job: NodeJob) -> FitResult:
    """Spawn ``job.config.nodes`` processes and return rank 0's result."""
    n = job.config.nodes
    ctx = node_context()
    results = ctx.Queue()
    # The rendezvous store lives here, in the parent, listening on loopback only.
    store, port = host_loopback_store(job.config.timeout_s)
    cores = callers_cores()  # the caller's of now: the fork server's may be older
    procs = [
        ctx.Process(target=_node_process, name=f"meshtrain-node-{r}", daemon=True,
                    args=(job, r, port, results, observers.active(), dict(os.environ), cores))
        for r in range(n)
    ]
    try:
        with _ctrl_c_deferred():
            for p in procs:
                p.start()
    except BaseException as exc:
        _stop(procs)  # those started, Ctrl-C or not: left alone they would outlive the run
        if not isinstance(exc, Exception):
            raise
        raise RuntimeError(
            f"could not start node processes ({exc}); the model, data and strategy must be "
            "picklable (top-level functions, no lambdas) for runtime='processes'"
        ) from exc
    done: dict[int, Any] = {}
    try:
        while len(done) < n:
            try:
                rank, status, payload = results.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if any(r not in done and p.exitcode not in (None, 0) for r, p in enumerate(procs)):
                    raise _first_failure(procs, results, done, {}) from None
                continue
            if status == "observe":
                method, args = payload
                observers.notify(method, *args)
                continue
            if status == "error":
                raise _first_failure(procs, results, done, {rank: payload}) from None
            done[rank] = payload
        for p in procs:
            p.join()
    finally:
        _stop(procs)
        del store  # closes the listening socket
    rank0 = done[0]
    model = copy.deepcopy(job.model)
    model.load_state_dict(torch.load(io.BytesIO(rank0["state_dict"]), weights_only=True))
    return FitResult(model=model, history=rank0["history"], run_dir=rank0["run_dir"],
                     summary=rank0["summary"])


def _first_failure(
    procs: list[Any], results: Any, done: dict[int, Any], errors: dict[int, tuple[float, str]]
) -> NodeFailed:
    """The failure that caused the others. A node that dies without a word (killed, out of
    memory, os._exit) makes its peers' collectives fail too, and their reports may arrive
    first: so wait briefly for every node to report or exit, then blame a node that exited
    silently before one whose error may only be the consequence.

    A node's report is in the queue's pipe before its exit code shows (the queue's feeder
    thread is joined as the process exits), so once the wait is over the queue is still
    read until empty: with the wait ended as soon as every node was seen settled, a node
    that reported and exited just before was once blamed for exiting silently."""
    deadline = time.monotonic() + FAILURE_GRACE_S
    while True:
        settled = all(r in done or r in errors or p.exitcode is not None for r, p in enumerate(procs))
        waiting = not settled and time.monotonic() < deadline
        try:
            rank, status, payload = results.get(timeout=POLL_SECONDS if waiting else 0)
        except queue.Empty:
            if not waiting:
                break
            continue
        if status == "error":
            errors.setdefault(rank, payload)
        elif status == "done":
            done[rank] = payload
    silent = [r for r, p in enumerate(procs)
              if r not in done and r not in errors and p.exitcode not in (None, 0)]
    if silent:
        return NodeFailed(silent[0], f"process exited with code {procs[silent[0]].exitcode}")
    # The first error by when it happened: a node reports its own error before it closes the
    # group, so its peers' errors (the closing's consequence) are later, though on a loaded
    # machine their reports may arrive first.
    first = min(errors, key=lambda r: errors[r][0])
    summary, _, node_traceback = errors[first][1].partition("\n")
    return NodeFailed(first, summary, node_traceback)


def _stop(procs: list[Any]) -> None:
    started = [p for p in procs if p.pid is not None]
    for p in started:
        if p.is_alive():
            p.terminate()
    for p in started:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
