"""The collectives strategies call, with exact byte accounting.

Strategies never touch torch.distributed. They call a :class:`Communicator`, which

* buckets many tensors into one flat buffer per collective,
* stages accelerator tensors through CPU where the backend needs it (gloo on MPS),
* counts the bytes this node sends and receives, per collective, and
* delegates the data movement to a backend (threads in one process, or
  torch.distributed point-to-point over gloo/nccl).

All-reduce is a ring (reduce-scatter then all-gather) in both backends, with the
same chunking and the same summation order, so results are bit-identical whether
nodes are threads or processes, and the byte counts are exactly the payload that
crosses the wire: for S bytes over g nodes, ``2 * (g - 1) / g * S`` per node when
S splits evenly.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast

import torch

from meshtrain.errors import RunFailure

ReduceOp = Literal["mean", "sum", "max"]
Group = Sequence[int]
#: Largest node report gather_json accepts (per-step numbers of a long run fit easily).
MAX_JSON_BYTES = 64 * 2**20
_Collective = TypeVar("_Collective", bound=Callable[..., Any])


@dataclass(frozen=True)
class CommRecord:
    """One collective as this node saw it."""

    step: int
    kind: str  # "all_reduce" | "all_gather" | "broadcast"
    bytes_sent: int
    bytes_received: int
    group_size: int
    #: A gradient bucket the launched runtime sends while the backward pass runs (a step
    #: whose backward pass is its only one): its time can hide behind that pass.
    during_backward: bool = False
    #: Steps of compute the collective runs beside (streaming DiLoCo's tau, DiLoCo's H under
    #: delay=1: started at its step, waited for that many steps later): its time hides
    #: behind theirs, and only what runs past them adds.
    overlap_steps: int = 0


@dataclass
class CommLog:
    """Every recorded collective of one node, plus running totals."""

    records: list[CommRecord] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0  # time spent inside recorded collectives (waiting included)

    def add(self, record: CommRecord) -> None:
        self.records.append(record)
        self.bytes_sent += record.bytes_sent
        self.bytes_received += record.bytes_received


def ring_chunk_sizes(numel: int, group_size: int) -> list[int]:
    """Element counts of the ``group_size`` ring chunks of a flat buffer (torch.tensor_split)."""
    base, extra = divmod(numel, group_size)
    return [base + 1 if i < extra else base for i in range(group_size)]


def ring_all_reduce_bytes(numel: int, element_size: int, position: int, group_size: int) -> tuple[int, int]:
    """Bytes (sent, received) by the node at ``position`` of a ring all-reduce.

    Reduce-scatter: the node sends every chunk but ``position + 1`` and receives every
    chunk but ``position``. All-gather: it sends every chunk but ``position + 2`` and
    receives every chunk but ``position + 1``.
    """
    if group_size == 1:
        return 0, 0
    sizes = ring_chunk_sizes(numel, group_size)
    total = numel
    g = group_size
    sent = (total - sizes[(position + 1) % g]) + (total - sizes[(position + 2) % g])
    received = (total - sizes[position % g]) + (total - sizes[(position + 1) % g])
    return sent * element_size, received * element_size


def ring_reduce(chunks_by_position: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """Reduce equal-shaped flat tensors exactly as the ring does.

    Chunk ``c`` is accumulated starting at position ``c`` and going round the ring:
    ``((x[c] + x[c+1]) + x[c+2]) + ...``. Both backends use this order, which is what
    makes threads and processes bit-identical.
    """
    g = len(chunks_by_position)
    result = torch.empty_like(chunks_by_position[0])
    for c, acc in enumerate(result.tensor_split(g)):  # each chunk accumulates in place
        ring_reduce_chunk_(acc, chunks_by_position, c, op)
    return result


def ring_reduce_chunk_(out: torch.Tensor, chunks_by_position: Sequence[torch.Tensor], c: int,
                       op: ReduceOp) -> None:
    """Write chunk ``c`` of :func:`ring_reduce`'s result into ``out``: the same additions in
    the same order, so chunks reduced separately (by different threads) match it bit for bit."""
    g = len(chunks_by_position)
    sizes = ring_chunk_sizes(chunks_by_position[0].numel(), g)
    start = sum(sizes[:c])  # chunk c as torch.tensor_split cuts it, one view per buffer
    out.copy_(chunks_by_position[c].narrow(0, start, sizes[c]))
    for k in range(1, g):
        _combine_(out, chunks_by_position[(c + k) % g].narrow(0, start, sizes[c]), op)
    if op == "mean":
        out.div_(g)


def ring_reduce_position_(outs: Sequence[torch.Tensor], chunks: Sequence[Sequence[torch.Tensor]],
                          c: int, op: ReduceOp) -> None:
    """:func:`ring_reduce_chunk_` for several buffers at once: ``outs[b]`` gets chunk ``c``
    of buffer ``b``'s ring reduction, where ``chunks[j][b]`` is member ``j``'s chunk ``c``
    of buffer ``b``. The same additions in the same order, one list operation per ring
    step for all buffers (many small buckets cost no more Python calls than one)."""
    g = len(chunks)
    torch._foreach_copy_(list(outs), list(chunks[c]))
    for k in range(1, g):
        others = chunks[(c + k) % g]
        if op == "max":
            for acc, other in zip(outs, others, strict=True):
                torch.maximum(acc, other, out=acc)
        else:
            torch._foreach_add_(list(outs), list(others))
    if op == "mean":
        torch._foreach_div_(list(outs), g)


#: :func:`ring_reduce_rows_`'s views, per ring step: (accumulators, pieces) of every buffer.
RowsPlan = list[tuple[list[torch.Tensor], list[torch.Tensor]]]


def ring_rows_plan(outs: Sequence[torch.Tensor], rows: Sequence[torch.Tensor]) -> RowsPlan:
    """The views :func:`ring_reduce_rows_` adds, ring step by ring step, for buffers whose
    members' copies are the rows of ``rows[b]`` and whose results go to ``outs[b]``.

    Chunk c adds member c, then c+1, ... (mod g), as :func:`ring_reduce_chunk_` does. At
    ring step k, the pieces to add (member (c + k) mod g, chunk c, for every c) lie on a
    diagonal of the rows: a strided view per run of equal-sized chunks, split where the
    member index wraps around. So a step is at most four views per buffer however many
    members there are, instead of one per chunk."""
    plan: RowsPlan = []
    for out, stacked in zip(outs, rows, strict=True):
        g, n = stacked.shape
        assert stacked.stride() == (n, 1) and out.is_contiguous() and out.numel() == n
        size, extra = divmod(n, g)
        # torch.tensor_split's chunks: the first ``extra`` hold size + 1 elements, the rest size.
        runs = [(0, extra, size + 1, 0), (extra, g, size, extra * (size + 1))]
        while len(plan) < g:
            plan.append(([], []))
        for k in range(g):
            accs, pieces = plan[k]
            for first, end, length, start in runs:
                # chunks c in [first, end) of member c + k, or c + k - g once that passes g - 1
                for lo, hi, shift in ((first, min(end, g - k), k), (max(first, g - k), end, k - g)):
                    if hi <= lo or length == 0:
                        continue
                    at = start + (lo - first) * length  # chunk lo's first element
                    pieces.append(stacked.as_strided((hi - lo, length), (n + length, 1),
                                                     stacked.storage_offset() + (lo + shift) * n + at))
                    accs.append(out.as_strided((hi - lo, length), (length, 1), out.storage_offset() + at))
    return plan


def ring_reduce_rows_(outs: Sequence[torch.Tensor], rows: Sequence[torch.Tensor], op: ReduceOp,
                      plan: RowsPlan | None = None) -> None:
    """:func:`ring_reduce` of each buffer whose members' copies are the rows of one tensor
    (``rows[b][j]`` is member j's), written into ``outs[b]``: every chunk of every buffer
    at once, one list operation per ring step (:func:`ring_rows_plan`; pass its ``plan``
    to reuse the views for the same tensors). The same additions in the same order as
    chunk by chunk, bit for bit."""
    for k, (accs, pieces) in enumerate(plan if plan is not None else ring_rows_plan(outs, rows)):
        if not accs:
            continue
        if k == 0:
            torch._foreach_copy_(accs, pieces)
        elif op == "max":
            for acc, piece in zip(accs, pieces, strict=True):
                _combine_(acc, piece, op)
        else:
            torch._foreach_add_(accs, pieces)
    if op == "mean":
        for out, stacked in zip(outs, rows, strict=True):
            out.div_(stacked.shape[0])


def _combine_(acc: torch.Tensor, other: torch.Tensor, op: ReduceOp) -> None:
    if op == "max":
        torch.maximum(acc, other, out=acc)
    else:
        acc.add_(other)


class NodeAborted(RunFailure):
    """Raised inside a node when another node failed and the run is stopping."""


def _clocked(collective: _Collective) -> _Collective:
    """Adds a collective's duration, on the communicator's ``collective_clock``, to its
    ``collective_clock_seconds``."""

    @functools.wraps(collective)
    def timed(self: Communicator, *args: Any, **kwargs: Any) -> Any:
        clock = self.collective_clock
        if clock is None:
            return collective(self, *args, **kwargs)
        started = clock()
        try:
            return collective(self, *args, **kwargs)
        finally:
            self.collective_clock_seconds += clock() - started

    return cast(_Collective, timed)


class Communicator(ABC):
    """Collectives over a set of nodes (ranks ``0 .. world_size - 1``).

    ``group`` arguments are sorted lists of global ranks; ``None`` means every alive node.
    A group costs nothing to create: islands can change every round.
    Every collective is recorded in :attr:`log` unless ``record=False`` (metrics
    traffic that a real deployment would not need is never counted).

    :attr:`alive` is the membership: every rank, until a simulated failure removes one
    (:meth:`set_alive`). Collectives then run among the alive ranks only, a group that
    names a departed rank included, so strategies average over the survivors unchanged.
    """


    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.alive: list[int] = list(range(world_size))
        self.log = CommLog()
        self.step = 0  # set by the trainer so records carry the training step
        # Time inside collectives (recorded or not) on the clock the loop measures compute
        # with, so that compute can exclude it; None: not kept.
        self.collective_clock: Callable[[], float] | None = None
        self.collective_clock_seconds = 0.0

    def set_alive(self, ranks: Sequence[int]) -> None:
        """From now on, collectives run among ``ranks`` only (every node calls this with the
        same ranks at the same point of the run)."""
        self.alive = sorted(ranks)

    @property
    def size(self) -> int:
        """How many nodes take part in a collective over everyone now (alive nodes)."""
        return len(self.alive)

    # ----------------------------------------------------------------- public API
    @_clocked
    def all_reduce(
        self,
        tensors: torch.Tensor | Sequence[torch.Tensor],
        op: ReduceOp = "mean",
        group: Group | None = None,
        *,
        record: bool = True,
    ) -> None:
        """Reduce tensors in place over ``group``, in one flat bucket per dtype (one bucket
        of several dtypes would send the narrow ones widened)."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for same in dtype_groups(tensors):
            self._all_reduce_bucket(same, op, group, record)

    def _all_reduce_bucket(self, tensors: list[torch.Tensor], op: ReduceOp, group: Group | None,
                           record: bool) -> None:
        """:meth:`all_reduce` of tensors of one dtype, in one flat bucket."""
        started = time.perf_counter()
        members = self.members(group)
        # One contiguous tensor is reduced through a view of itself; several are bucketed.
        alone = len(tensors) == 1 and tensors[0].is_contiguous()
        flat = tensors[0].detach().view(-1) if alone else _flatten(tensors)
        if len(members) > 1:
            reduced = self._ring_all_reduce(flat.to(self.staging_device(flat)), op, members)
            if not alone:  # straight from the result into the tensors: no copy back into the bucket
                _unflatten_into(reduced, tensors)
            elif reduced is not flat:  # a backend may reduce in place
                flat.copy_(reduced)
        if record:
            self.log.add(self._all_reduce_record(flat, members, self.step))
            self.log.seconds += time.perf_counter() - started

    @_clocked
    def all_reduce_buckets(
        self,
        buckets: Sequence[Sequence[torch.Tensor]],
        op: ReduceOp = "mean",
        group: Group | None = None,
        *,
        record: bool = True,
    ) -> None:
        """Reduce each bucket of tensors (of one dtype each, as
        :func:`~meshtrain.comm.buckets.bucket_layout` cuts them) in place over ``group``, one
        :meth:`all_reduce` per bucket, in order (a backend may serve them in one meeting of
        the members, with the same result bit for bit and the same records)."""
        for bucket in buckets:
            self.all_reduce(bucket, op, group, record=record)

    @_clocked
    def all_gather(
        self, tensor: torch.Tensor, group: Group | None = None, *, record: bool = True
    ) -> list[torch.Tensor]:
        """Every member's ``tensor`` (same shape and dtype everywhere), in group order."""
        started = time.perf_counter()
        members = self.members(group)
        if len(members) == 1:
            out = [tensor.clone()]
        else:
            staged = tensor.to(self.staging_device(tensor))
            out = [t.to(tensor.device) for t in self._all_gather(staged.contiguous(), members)]
        if record:
            nbytes = tensor.numel() * tensor.element_size() * (len(members) - 1)
            self._record("all_gather", nbytes, nbytes, len(members), started)
        return out

    @_clocked
    def broadcast(
        self, tensors: torch.Tensor | Sequence[torch.Tensor], src: int = 0,
        group: Group | None = None, *, record: bool = True,
    ) -> None:
        """Copy ``src``'s tensors into every member's, in place (one flat bucket per dtype,
        as :meth:`all_reduce`)."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for same in dtype_groups(tensors):
            self._broadcast_bucket(same, src, group, record)

    def _broadcast_bucket(self, tensors: list[torch.Tensor], src: int, group: Group | None,
                          record: bool) -> None:
        """:meth:`broadcast` of tensors of one dtype, in one flat bucket."""
        started = time.perf_counter()
        members = self.members(group)
        flat = _flatten(tensors)
        if len(members) > 1:
            received = self._broadcast(flat.to(self.staging_device(flat)), src, members)
            flat.copy_(received)
            _unflatten_into(flat, tensors)
        if record:
            nbytes = flat.numel() * flat.element_size()
            if self.rank == src:
                self._record("broadcast", nbytes * (len(members) - 1), 0, len(members), started)
            else:
                self._record("broadcast", 0, nbytes, len(members), started)

    def gather_json(self, value: Any, *, max_bytes: int = MAX_JSON_BYTES) -> list[Any] | None:
        """Rank 0 gets every alive node's ``value`` (JSON-able), in rank order; others get
        None. Never recorded.

        Values travel as UTF-8 JSON in uint8 tensors, never pickled: a peer can send data,
        not code. A payload over ``max_bytes`` is refused on both sides.
        """
        payload = json.dumps(value, allow_nan=True).encode()
        if len(payload) > max_bytes:
            raise ValueError(f"node {self.rank}: report of {len(payload)} bytes exceeds {max_bytes}")
        sizes = self.all_gather(torch.tensor([len(payload)], dtype=torch.int64), record=False)
        longest = int(max(int(s) for s in sizes))
        if longest > max_bytes:
            raise ValueError(f"a node's report of {longest} bytes exceeds {max_bytes}")
        buffer = torch.zeros(longest, dtype=torch.uint8)
        buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        gathered = self.all_gather(buffer, record=False)
        if self.rank != 0:
            return None
        return [
            json.loads(bytes(t[: int(n)].tolist()).decode())
            for t, n in zip(gathered, sizes, strict=True)
        ]

    #: True where :meth:`all_reduce_bucket` may run on a second thread while the node's
    #: own thread computes (the backward pass; see :mod:`meshtrain.comm.buckets`).
    reduces_in_background = False

    def all_reduce_bucket(self, flat: torch.Tensor, op: ReduceOp, members: list[int], step: int, *,
                          record: bool = True, during_backward: bool = False) -> torch.Tensor:
        """All-reduce one flat bucket already cut and filled, from a background thread:
        the reduced bucket (``flat`` itself where the backend reduces in place). Its bytes
        are recorded as :meth:`all_reduce` records them; its time is not (the node's thread
        keeps the clock, by the time it waits for the bucket)."""
        reduced = flat
        if len(members) > 1:
            reduced = self._ring_all_reduce(flat.to(self.staging_device(flat)), op, members)
        if record:
            self.log.add(self._all_reduce_record(flat, members, step, during_backward))
        return reduced

    def node_logs(self) -> list[CommLog]:
        """The log of every node this communicator plays (one; the vmap runtime's, all)."""
        return [self.log]

    def set_node_logs(self, logs: list[CommLog]) -> None:
        """Record into ``logs`` from now on (as :meth:`node_logs` lists them)."""
        (self.log,) = logs

    def transaction(self, body: Callable[[], object], *, snapshot: Callable[[], Any],
                    restore: Callable[[Any], None], admit: bool, step: int, meet: bool = False) -> None:
        """Run ``body``, one step's communicating work. An elastic run's communicator
        (:mod:`meshtrain.comm.elastic`) undoes it with ``restore(snapshot())`` and does it
        again when a peer is lost in it, and admits rejoining nodes after it where
        ``admit``; a fixed group just runs it. ``meet`` (the same on every node): the
        members agree on the outcome even where this node sent nothing, as at a sync where
        some nodes average in islands and one alone says nothing (elastic runs skip the
        agreement otherwise when a node sent nothing)."""
        body()

    def open_side_channel(self) -> Communicator | None:
        """A communicator whose collectives may run on a second thread while this one's
        thread trains and communicates (:class:`BesideTraining`), or None where
        the backend has none (threads, vmap, nccl): work "beside" then runs at once, with
        the same result. Every node calls it at the same point of the run (``setup``)."""
        return None

    def staging_device(self, tensor: torch.Tensor) -> torch.device:
        """Where a tensor must be for this backend to move it (CPU unless overridden)."""
        return tensor.device

    def abort(self, error: BaseException) -> None:  # noqa: B027 - optional hook
        """Tell waiting peers to stop (in-process backends); default does nothing."""

    def check_abort(self) -> None:  # noqa: B027 - optional hook
        """Raise :class:`NodeAborted` if the run is stopping (in-process backends check this
        at every step, so a node between collectives stops within one step)."""

    # ------------------------------------------------------------ backend hooks
    @abstractmethod
    def _ring_all_reduce(self, flat: torch.Tensor, op: ReduceOp, members: list[int]) -> torch.Tensor:
        """Return the reduction of ``flat`` over members (same order as :func:`ring_reduce`);
        a backend may reduce into ``flat`` itself and return it."""

    def _all_reduce_record(self, flat: torch.Tensor, members: list[int], step: int,
                           during_backward: bool = False) -> CommRecord:
        """What this node sends and receives in a ring all-reduce of ``flat``."""
        sent, received = ring_all_reduce_bytes(flat.numel(), flat.element_size(),
                                               members.index(self.rank), len(members))
        return CommRecord(step, "all_reduce", sent, received, len(members), during_backward)

    @abstractmethod
    def _all_gather(self, flat: torch.Tensor, members: list[int]) -> list[torch.Tensor]: ...

    @abstractmethod
    def _broadcast(self, flat: torch.Tensor, src: int, members: list[int]) -> torch.Tensor: ...

    # ------------------------------------------------------------------ helpers
    def members(self, group: Group | None = None) -> list[int]:
        """The ranks a collective over ``group`` (None: everyone) runs among: its alive ones."""
        if group is None:
            return list(self.alive)
        members = sorted(group)
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} is not in group {members}")
        if len(self.alive) < self.world_size:  # a departed node's island goes on without it
            members = [m for m in members if m in self.alive]
        return members

    def _record(self, kind: str, sent: int, received: int, group_size: int, started: float) -> None:
        self.log.add(CommRecord(self.step, kind, sent, received, group_size))
        self.log.seconds += time.perf_counter() - started


def dtype_groups(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by dtype, the groups in the order their dtype first appears (the
    same on every node, whose tensor lists are alike)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if len(tensors) == 1:
        return tensors[0].detach().reshape(-1).clone()
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat``'s consecutive pieces into ``tensors``."""
    sizes = [t.numel() for t in tensors]
    if tensors and all(t.is_contiguous() and (t.dtype, t.device) == (flat.dtype, flat.device)
                       for t in tensors):
        # One list copy: half the time of a copy per tensor for the gpt model's 28 tensors.
        with torch.no_grad():
            torch._foreach_copy_([t.view(-1) for t in tensors], list(flat[: sum(sizes)].split(sizes)))
        return
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


# ------------------------------------------------------------------ beside training
# Collectives started now and waited for steps later, while the node trains on.
#
# Streaming DiLoCo's fragment syncs and DiLoCo's delayed outer step start an all-reduce at
# one step and use its result a few steps later. Where the communicator has a side channel
# (torch.distributed over gloo: processes runtime and launched hosts), the work runs on one
# worker thread over that channel's own process group, so its ring overlaps the node's
# next steps and never mixes messages with the collectives the node's thread posts. Where
# it has none (threads, vmap), the work runs when it is started. Either way the result is
# used at the same step and the same ring sums the same values, so every runtime computes
# the same numbers (bit for bit where the runtimes already agree).

#: Work to run beside training: given the communicator to use, it reduces in place.
SideWork = Callable[[Communicator], None]


class Pending:
    """Work :meth:`BesideTraining.start` started; :meth:`wait` until it is done.

    Its records join the node's log when it is waited for, in every runtime, so the bytes
    of a run's steps are the same whether the work ran beside training or at once (each
    record keeps the step the work started at)."""

    def __init__(self, comm: Communicator | None = None, *, beside: bool = False) -> None:
        self._comm = comm
        self._beside = beside
        self._done = threading.Event()
        self._records: list[list[CommRecord]] = []  # by node log (the vmap runtime has several)
        self._error: BaseException | None = None
        if not beside:
            self._done.set()

    def wait(self) -> None:
        """Block until the work is done; its records join the node's log, and where it ran
        beside training the wait counts as communication time (the transfer that overlapped
        training does not)."""
        comm, self._comm = self._comm, None
        if comm is None:
            return
        if self._beside:
            clock = comm.collective_clock
            started, clocked = time.perf_counter(), clock() if clock is not None else 0.0
            self._done.wait()
            comm.log.seconds += time.perf_counter() - started
            if clock is not None:
                comm.collective_clock_seconds += clock() - clocked
        for log, records in zip(comm.node_logs(), self._records, strict=False):
            for record in records:
                log.add(record)
        if self._error is not None:
            raise self._error

    def saved(self) -> list[list[tuple[Any, ...]]]:
        """For a checkpoint: block until the work is done (raising its error) and return its
        records, still unlogged, as :meth:`restored` takes them back."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return [[dataclasses.astuple(r) for r in records] for records in self._records]

    @classmethod
    def restored(cls, comm: Communicator, records: list[list[tuple[Any, ...]]]) -> Pending:
        """Finished work read back from a checkpoint: its records join ``comm``'s log when it
        is waited for, at the same step as in a run that was never interrupted."""
        pending = cls(comm)
        pending._records = [[CommRecord(*r) for r in node] for node in records]
        return pending


class BesideTraining:
    """Runs :data:`SideWork` beside a node's training, in the order it is started."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.side = comm.open_side_channel()
        self._jobs: queue.SimpleQueue[Callable[[], None]] | None = None

    @property
    def overlaps(self) -> bool:
        """Whether started work really runs while the node trains on."""
        return self.side is not None

    def start(self, work: SideWork, overlap_steps: int) -> Pending:
        """Start ``work``, to be waited for ``overlap_steps`` steps later (its records say
        so, for the projection); where there is no side channel it runs now, on this
        communicator."""
        def marked(log: CommLog) -> list[CommRecord]:
            return [dataclasses.replace(r, overlap_steps=overlap_steps) for r in log.records]

        if self.side is None:
            logs = self.comm.node_logs()
            held = [CommLog() for _ in logs]
            self.comm.set_node_logs(held)
            try:
                work(self.comm)
            finally:
                self.comm.set_node_logs(logs)
            for log, kept in zip(logs, held, strict=True):
                log.seconds += kept.seconds
            pending = Pending(self.comm)
            pending._records = [marked(kept) for kept in held]
            return pending
        side = self.side
        pending = Pending(self.comm, beside=True)
        step, alive = self.comm.step, list(self.comm.alive)

        def job() -> None:
            try:
                side.log, side.step = CommLog(), step
                side.set_alive(alive)
                work(side)
                pending._records = [marked(side.log)]
            except BaseException as exc:  # handed to the node's thread, which raises it
                pending._error = exc
            finally:
                pending._done.set()

        if self._jobs is None:
            self._jobs = start_worker("meshtrain-beside-training")
        self._jobs.put(job)
        return pending


def start_worker(name: str) -> queue.SimpleQueue[Callable[[], None]]:
    """A daemon thread running the jobs put on the returned queue, one at a time, at the
    node's intra-op thread count (a new thread would otherwise take torch's default, and its
    sums would not match the node thread's bit for bit)."""
    jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
    threads = torch.get_num_threads()

    def run() -> None:
        torch.set_num_threads(threads)
        while True:
            jobs.get()()

    threading.Thread(target=run, name=name, daemon=True).start()
    return jobs
