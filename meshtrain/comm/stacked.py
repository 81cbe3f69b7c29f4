"""Collectives of the vmap runtime: every node's tensor is one row of a stacked tensor.

In the vmap runtime one strategy object drives all nodes at once: its tensors carry the
nodes along dimension 0 (``[nodes, *shape]``). A collective is then a reduction over that
dimension, written back into every row, and nothing is copied between nodes.

The byte accounting is the threads runtime's, node by node: every node keeps its own
:class:`~meshtrain.comm.communicator.CommLog` (:attr:`StackedCommunicator.logs`), and a
collective records in each what that node would send and receive in the ring (its
position decides which uneven chunk it skips). Bytes per node are identical to the threads
runtime's for the same run; the sums themselves are not bit-identical (a reduction over a
dimension adds in another order than the ring).

Only collectives over every node are possible: in one call all nodes reduce together, so
groups that differ from node to node (FedAvg's islands) cannot be expressed.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import torch

from meshtrain.comm.communicator import (
    CommLog,
    CommRecord,
    Communicator,
    Group,
    ReduceOp,
    dtype_groups,
    ring_all_reduce_bytes,
)


class StackedCommunicator(Communicator):
    """Collectives over the node dimension (0) of stacked tensors, for ``nodes`` nodes.

    It plays every node: :attr:`rank` is 0 and :attr:`log` is node 0's log (what rank 0
    projects a run from); :attr:`logs` holds every node's.
    """

    def __init__(self, nodes: int) -> None:
        super().__init__(0, nodes)
        self.logs = [CommLog() for _ in range(nodes)]
        self.log = self.logs[0]

    def node_logs(self) -> list[CommLog]:
        return self.logs

    def set_node_logs(self, logs: list[CommLog]) -> None:
        self.logs, self.log = logs, logs[0]

    def all_reduce(
        self,
        tensors: torch.Tensor | Sequence[torch.Tensor],
        op: ReduceOp = "mean",
        group: Group | None = None,
        *,
        record: bool = True,
    ) -> None:
        """Reduce every stacked tensor over its node dimension, in place, into every row
        (counted as the other runtimes send them: one bucket per dtype)."""
        started = time.perf_counter()
        tensors = self._stacked(tensors)
        if not tensors:
            return
        members = self._everyone(group)
        with torch.no_grad():
            for t in tensors:
                t.copy_(_reduce_rows(t, op).expand_as(t))
        if record:
            for same in dtype_groups(tensors):  # one ring per dtype, as the other runtimes send
                numel = sum(t[0].numel() for t in same)
                counts = _ring_bytes_by_position(numel, same[0].element_size(), len(members))
                for log, (sent, received) in zip(self.logs, counts, strict=True):
                    self._record_node(log, "all_reduce", sent, received, len(members))
            self.log.seconds += time.perf_counter() - started

    def all_gather(
        self, tensor: torch.Tensor, group: Group | None = None, *, record: bool = True
    ) -> list[torch.Tensor]:
        """Every node's row of ``tensor``, in node order (each node would get the same list)."""
        started = time.perf_counter()
        members = self._everyone(group)
        self._check_stacked(tensor)
        out = [row.clone() for row in tensor]
        if record:
            nbytes = tensor[0].numel() * tensor.element_size() * (len(members) - 1)
            for log in self.logs:
                self._record_node(log, "all_gather", nbytes, nbytes, len(members))
            self.log.seconds += time.perf_counter() - started
        return out

    def broadcast(
        self, tensors: torch.Tensor | Sequence[torch.Tensor], src: int = 0,
        group: Group | None = None, *, record: bool = True,
    ) -> None:
        """Copy row ``src`` of every stacked tensor into every other row (counted as the
        other runtimes send it: one bucket per dtype)."""
        started = time.perf_counter()
        tensors = self._stacked(tensors)
        members = self._everyone(group)
        with torch.no_grad():
            for t in tensors:
                t.copy_(t[src : src + 1].expand_as(t))
        if record and tensors:
            for same in dtype_groups(tensors):
                nbytes = sum(t[0].numel() for t in same) * same[0].element_size()
                for rank, log in enumerate(self.logs):
                    if rank == src:
                        self._record_node(log, "broadcast", nbytes * (len(members) - 1), 0, len(members))
                    else:
                        self._record_node(log, "broadcast", 0, nbytes, len(members))
            self.log.seconds += time.perf_counter() - started

    def _everyone(self, group: Group | None) -> list[int]:
        if group is not None and sorted(group) != list(range(self.world_size)):
            raise ValueError("the vmap runtime reduces over every node at once; a collective "
                             f"over group {sorted(group)} cannot run in it")
        return list(range(self.world_size))

    def _stacked(self, tensors: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors of a collective, each checked to be stacked over the nodes."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for t in tensors:
            self._check_stacked(t)
        return tensors

    def _check_stacked(self, tensor: torch.Tensor) -> None:
        if tensor.dim() == 0 or tensor.shape[0] != self.world_size:
            raise ValueError(f"the vmap runtime's collectives take tensors stacked over the "
                             f"{self.world_size} nodes along dimension 0, got shape {tuple(tensor.shape)}")

    def _record_node(self, log: CommLog, kind: str, sent: int, received: int, group_size: int) -> None:
        log.add(CommRecord(self.step, kind, sent, received, group_size))

    # The public collectives above never reach a backend hook.
    def _ring_all_reduce(self, flat: torch.Tensor, op: ReduceOp, members: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def _all_gather(self, flat: torch.Tensor, members: list[int]) -> list[torch.Tensor]:
        raise NotImplementedError

    def _broadcast(self, flat: torch.Tensor, src: int, members: list[int]) -> torch.Tensor:
        raise NotImplementedError


def _reduce_rows(stacked: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    if op == "mean":
        return stacked.mean(dim=0, keepdim=True)
    if op == "sum":
        return stacked.sum(dim=0, keepdim=True)
    return stacked.amax(dim=0, keepdim=True)


@functools.lru_cache(maxsize=256)
def _ring_bytes_by_position(numel: int, element_size: int, group_size: int) -> tuple[tuple[int, int], ...]:
    """(sent, received) of every ring position: a run repeats the same few collectives."""
    return tuple(ring_all_reduce_bytes(numel, element_size, position, group_size)
                 for position in range(group_size))
