"""This process is one rank of a launched run (``meshtrain launch`` or torchrun).

Takes its place in the group from :func:`meshtrain.config.environment.launched_rank` (the torchrun
variables, and MESHTRAIN_TIMEOUT, seconds a collective may wait), joins the TCP
rendezvous, trains its node, and leaves the group.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from meshtrain.comm.elastic import ElasticCommunicator, open_elastic_store
from meshtrain.comm.sealing import GLOO_HINT, bind_gloo_to_advertise, raise_open_file_limit
from meshtrain.comm.torch_dist import TorchDistCommunicator, init_process_group, leave_in_order
from meshtrain.config.environment import RankEnvironmentError, launched_rank
from meshtrain.devices import resolve_device
from meshtrain.engine.job import FitResult, NodeFailed, NodeJob
from meshtrain.engine.loop import node_seed, train_node
from meshtrain.heartbeat import start_heartbeat


def run_launched_rank(job: NodeJob) -> FitResult:
    """Train ``job`` as the rank the environment names."""
    place = launched_rank()
    if place is None:
        raise RankEnvironmentError("runtime 'launched' needs RANK and WORLD_SIZE (set by meshtrain "
                                   "launch or torchrun)")
    addr, port = place.rendezvous()
    rank, world = place.rank, place.world_size
    raise_open_file_limit()  # headroom for gloo, which holds a descriptor per connection
    bind_gloo_to_advertise()  # gloo listens where the inventory says this host is reached
    start_heartbeat()  # no-op unless `meshtrain launch` started this rank
    timeout = place.timeout_s if place.timeout_s is not None else job.config.timeout_s
    try:
        if place.elastic_s is not None:
            return train_elastic(job, rank, world, addr, port, timeout, place.elastic_s,
                                 joining=place.joining)
        return join_and_train(job, rank, world, addr, port, timeout, verify_replicas=True)
    except Exception as exc:  # the same error a simulated node raises, traceback kept
        message = f"{type(exc).__name__}: {exc}"
        if "gloo" in message.lower():
            message += f" ({GLOO_HINT})"
        raise NodeFailed(rank, message, traceback.format_exc()) from exc


def join_and_train(
    job: NodeJob, rank: int, world: int, addr: str, port: int, timeout_s: float,
    *, verify_replicas: bool, external_store: bool = False,
    on_failure: Callable[[BaseException], None] | None = None,
) -> FitResult:
    """Join the group as ``rank`` and train; used by launched ranks and local processes.

    ``on_failure`` hears of this rank's own error before the group closes: the errors of the
    peers that the closing causes come after it."""
    device = resolve_device(job.config.device)
    # MKL and OpenMP round a matmul differently at different thread counts: results match
    # another runtime bit for bit only at the same count, so it is a setting, set here.
    if job.config.threads:
        torch.set_num_threads(job.config.threads)
    init_process_group(rank, world, addr, port, device, timeout_s, external_store=external_store)
    try:
        torch.manual_seed(node_seed(job.config.seed, rank))
        comm = TorchDistCommunicator()
        result = train_node(job, comm, verify_replicas=verify_replicas)
        _barrier(comm)  # every rank is done with gloo
    except BaseException as exc:
        if on_failure is not None:
            on_failure(exc)
        dist.destroy_process_group()
        raise
    leave_in_order(rank, world, timeout_s)
    return result


def _barrier(comm: TorchDistCommunicator) -> None:
    """Wait until every rank still in the run is done. A node that left early (a simulated
    ``--fail``) skips it and leaves at once, so it never waits, for the rest of the run,
    on a barrier that could time out; the survivors meet among themselves."""
    if len(comm.alive) == comm.world_size:
        dist.barrier()
    elif comm.rank in comm.alive:
        comm.all_reduce(torch.zeros(1), op="sum", record=False)  # a ring needs every member


def train_elastic(job: NodeJob, slot: int, slots: int, addr: str, port: int, timeout_s: float,
                  heartbeat_s: float, *, joining: bool) -> FitResult:
    """Train as slot ``slot`` of an elastic run (``launch --elastic``): through the gate to
    rank 0's store, a group that goes on without a lost rank and takes it back
    (:mod:`meshtrain.comm.elastic`); ``joining``: this rank was started again to rejoin."""
    if job.config.threads:
        torch.set_num_threads(job.config.threads)
    torch.manual_seed(node_seed(job.config.seed, slot))
    place = open_elastic_store(slot, slots, addr, port, timeout_s, heartbeat_s, joining=joining)
    comm = ElasticCommunicator(place.table, heartbeat_s, seal=place.seal)
    if joining:
        result = train_node(job, comm, join_timeout=timeout_s)
    else:
        place.all_ready(timeout_s)  # every slot is up: the first group forms within the heartbeat
        comm.start()
        result = train_node(job, comm, verify_replicas=True)
    place.leave(len(comm.alive), timeout_s)
    return result
