"""In-process collectives: every node is a thread and tensors never leave memory.

Each collective is a *round* keyed by (group, sequence number). Members deposit
their tensor; the last to arrive computes the result once and wakes the others. An
all-reduce is shared out instead: once every member has deposited, the member at ring
position ``c`` reduces chunk ``c`` of the result (in the ring's summation order, so
the result is the same bit for bit), as the nodes of a real ring would. If any node
fails, :meth:`ThreadHub.abort` wakes every waiter with :class:`NodeAborted`, so one
failure never hangs the rest; a node that waits longer than ``timeout_s`` for its peers
raises :class:`TimeoutError`.

Run slots: a hub made with ``slots=k`` lets at most k node threads compute at a time. A
node holds a slot while it runs and gives it up whenever it waits for its peers, or, at a
step's start, once it has held it for :data:`SLOT_TURN_SECONDS` while others wait for one.
torch releases Python's interpreter lock around every operation and takes it back after;
with more runnable threads than cores, or operations of microseconds, those hand-offs cost
as much as the arithmetic. Slots are handed on in the order nodes asked for them. The turns
matter where nodes seldom meet (DiLoCo with a large H): on one slot the first node once ran
all its steps before the next began, so a failure on another node surfaced only at the end
of the run, and nodes waiting that long for a slot met the collective timeout.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from meshtrain.comm.communicator import (
    Communicator,
    Group,
    NodeAborted,
    ReduceOp,
    RowsPlan,
    _clocked,
    ring_reduce_position_,
    ring_reduce_rows_,
    ring_rows_plan,
)


@dataclass
class _Round:
    expected: int
    payloads: dict[int, Any] = field(default_factory=dict)
    result: Any = None
    done: bool = False
    reduced: set[int] = field(default_factory=set)  # members whose chunk is written (all-reduce)
    cut: _Cut | None = None  # all-reduce: the group's results cut into ring chunks
    pieces: dict[int, list[tuple[torch.Tensor, ...]]] = field(default_factory=dict)  # rank -> [b][c]
    in_rows: int = 0  # members that deposited their rows of ``cut.rows``


@dataclass
class _Cut:
    """One group's all-reduce of buffers of given sizes, cut into ring chunks: the results
    (reused round after round: every member has read a round's result before any deposits
    for the next) and each member's buffers, cut once while the member deposits the same
    buffers (:meth:`ThreadCommunicator.all_reduce_buckets` keeps them). Cutting a buffer into
    64 views costs as much as adding it up, so it is done once, not every step."""

    results: list[torch.Tensor]
    result_pieces: list[tuple[torch.Tensor, ...]]
    # rank -> (the buffers' addresses, their pieces: pieces[b][c] is chunk c of buffer b)
    pieces: dict[int, tuple[list[int], list[tuple[torch.Tensor, ...]]]] = field(default_factory=dict)
    # Buffers the members keep (:meth:`ThreadHub.bucket_rows`): bucket b of member j is
    # rows[b][j], so one member can reduce every chunk with a few strided operations.
    rows: list[torch.Tensor] | None = None
    rows_plan: RowsPlan | None = None  # ring_reduce_rows_'s views of ``rows`` and ``results``


#: How long a node computes on its run slot, while other nodes wait for one, before it hands
#: the slot on at its next step: about ten turns a second per slot, so the hand-offs (a thread
#: woken, the next node's model and optimizer state back in the cache) cost well under 1%.
SLOT_TURN_SECONDS = 0.1


class ThreadHub:
    """Shared meeting point of the threads of one simulated cluster."""

    def __init__(self, world_size: int, timeout_s: float | None = None,
                 slots: int | None = None) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        # One lock for the hub's state, and a condition on it per node: whoever makes a
        # node's wait end (a round complete, a slot handed on) wakes that node alone.
        # Waking every waiter instead made each woken thread take the lock and the
        # interpreter lock only to go back to sleep: 64 nodes on 2 slots met 30% slower
        # (benchmarks/hub_meetings.py).
        self._lock = threading.RLock()
        self._wakes = [threading.Condition(self._lock) for _ in range(world_size)]
        self._waiting: dict[int, Callable[[], bool]] = {}  # node -> what it waits for
        self._rounds: dict[tuple[tuple[int, ...], int], _Round] = {}
        self._error: BaseException | None = None
        # Run slots (None: every node runs whenever it can), handed on in the order the
        # nodes became ready to run.
        self._slots = slots
        self._free_slots = slots or 0
        self._slot_queue: collections.deque[int] = collections.deque()
        self._holding: dict[int, float] = {}  # node -> when it got its slot
        self._cuts: dict[tuple[Any, ...], _Cut] = {}

    def abort(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
            for wake in self._wakes:
                wake.notify_all()

    def take_slot(self, rank: int) -> None:
        """Wait for a run slot for node ``rank`` (no-op without slots)."""
        if self._slots is None:
            return
        with self._lock:
            self._sleep(rank, lambda: True, set)
            self._check()  # a slot is no meeting's result: a failed peer ends the wait for one

    def give_slot(self, rank: int) -> None:
        """Give node ``rank``'s run slot to the next node waiting for one (if it holds one)."""
        with self._lock:
            self._give_slot(rank)

    def take_turn(self, rank: int) -> None:
        """Between two steps of node ``rank``: raise :class:`NodeAborted` if a node has
        failed; and if the node has held its run slot for :data:`SLOT_TURN_SECONDS` while
        others wait for one, hand it to the next and queue for it again."""
        with self._lock:
            self._check()
            since = self._holding.get(rank)
            if since is None or not self._slot_queue or time.monotonic() - since < SLOT_TURN_SECONDS:
                return
            self._give_slot(rank)
            self.take_slot(rank)  # behind the nodes already waiting (the lock is reentrant)

    def queued(self, rank: int) -> bool:
        """Whether node ``rank`` is waiting for a run slot (ready to run, none free)."""
        with self._lock:
            return rank in self._slot_queue

    def _give_slot(self, rank: int) -> None:
        if rank not in self._holding:
            return
        del self._holding[rank]
        if self._slot_queue:
            self._grant(self._slot_queue.popleft())
        else:
            self._free_slots += 1

    def _grant(self, rank: int) -> None:
        """Node ``rank`` holds a slot from now on; wake it (holding the lock)."""
        self._holding[rank] = time.monotonic()
        self._wakes[rank].notify()

    def _claim_slot(self, rank: int) -> None:
        """Node ``rank`` is ready to run: take a free slot, or queue for the next one."""
        if rank in self._holding or rank in self._slot_queue:
            return
        if self._free_slots > 0 and not self._slot_queue:
            self._free_slots -= 1
            self._holding[rank] = time.monotonic()
        else:
            self._slot_queue.append(rank)

    def _poke(self, members: Sequence[int]) -> None:
        """The rounds of ``members`` moved on: give each one whose wait is over a slot (or
        its place in the queue for one) and wake it (holding the lock)."""
        for m in members:
            ready = self._waiting.get(m)
            if ready is None or not ready():
                continue
            if self._slots is None:
                self._wakes[m].notify()
                continue
            self._claim_slot(m)
            if m in self._holding:
                self._wakes[m].notify()

    def _await(self, rank: int, ready: Callable[[], bool], missing: Callable[[], set[int]]) -> None:
        """Wait (holding the lock) until ``ready()``, giving this node's run slot to
        another node meanwhile and taking one back before returning."""
        if ready():
            return
        self._give_slot(rank)
        self._sleep(rank, ready, missing)

    def _sleep(self, rank: int, ready: Callable[[], bool], missing: Callable[[], set[int]]) -> None:
        """Sleep (holding the lock) until ``ready()`` and node ``rank`` holds a run slot;
        raise on a failed peer, or on a timeout naming the ``missing()`` members (or the
        holders of the slots)."""
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        self._waiting[rank] = ready
        try:
            while True:
                if ready():
                    # A wait that is over stays over when a peer fails afterwards: the node
                    # gets what the meeting gave it (rank 0 commits the checkpoint all nodes
                    # had saved) and stops at its next check, slot or no slot.
                    if self._slots is None or self._error is not None:
                        return
                    self._claim_slot(rank)
                    if rank in self._holding:
                        return
                self._check()
                if deadline is not None and time.monotonic() >= deadline:
                    waiting_for = (f"a run slot, held by nodes {sorted(self._holding)}" if ready()
                                   else f"nodes {sorted(missing())}")
                    raise TimeoutError(f"collective waited more than {self.timeout_s:g} s for "
                                       f"{waiting_for}")
                wait = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
                self._wakes[rank].wait(timeout=wait)
        finally:
            del self._waiting[rank]
            if rank in self._slot_queue:  # a timeout or a failed peer: not waiting any more
                self._slot_queue.remove(rank)

    def exchange(
        self,
        key: tuple[tuple[int, ...], int],
        rank: int,
        payload: Any,
        combine: Callable[[list[Any]], Any],
    ) -> Any:
        """Deposit ``payload``; return ``combine(payloads in member order)``, computed once."""
        members = key[0]
        with self._lock:
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
            with self._lock:
                rnd.result, rnd.done = result, True
                self._poke(members)
            return result
        with self._lock:
            self._await(rank, lambda: rnd.done, lambda: set(members) - set(rnd.payloads))
            return rnd.result

    def all_reduce(
        self, key: tuple[tuple[int, ...], int], rank: int, flats: list[torch.Tensor], op: ReduceOp,
        *, kept: bool = False,
    ) -> list[torch.Tensor]:
        """Deposit ``flats`` (one or more buckets, each reduced as its own ring); once every
        member has, reduce this member's ring chunk of each result; return the results when
        every chunk is written (tensors shared by the members: read them, never write them).

        With fewer run slots than members the chunks could not be reduced in parallel
        anyway: the last member to arrive reduces them all (the same sums, in the same
        order), sparing every other member a second wait for a slot.

        ``kept``: the member deposits these same buffers round after round, so their cut
        into chunks is kept for the next round (otherwise they are cut anew)."""
        members = key[0]
        g = len(members)
        alone = self._slots is not None and self._slots < g
        with self._lock:
            self._check()
            rnd = self._rounds.setdefault(key, _Round(expected=g))
            if rnd.cut is None:
                rnd.cut = self._cut_for(members, _shapes(flats))
                rnd.result = rnd.cut.results
            rows, position = rnd.cut.rows, members.index(rank)
            if rows is not None and all(f.data_ptr() == r[position].data_ptr()
                                        for f, r in zip(flats, rows, strict=True)):
                rnd.in_rows += 1
            addresses = [flat.data_ptr() for flat in flats]
            known = rnd.cut.pieces.get(rank) if kept else None
            if known is not None and known[0] == addresses:
                rnd.pieces[rank] = known[1]
            else:
                rnd.pieces[rank] = [flat.tensor_split(g) for flat in flats]
                if kept:
                    rnd.cut.pieces[rank] = (addresses, rnd.pieces[rank])
            rnd.payloads[rank] = flats
            last = len(rnd.payloads) == g
            if last:
                del self._rounds[key]
                if not alone:  # members alone wait for the result only (rnd.done)
                    self._poke(members)
            if alone and not last:
                self._await(rank, lambda: rnd.done, lambda: set(members) - set(rnd.payloads))
                return list(rnd.result)
            self._await(rank, lambda: len(rnd.payloads) == g, lambda: set(members) - set(rnd.payloads))
        mine = range(g) if alone else [position]
        try:
            # Outside the lock: the members reduce their chunks in parallel.
            cut, buffers = rnd.cut, range(len(rnd.result))
            assert cut is not None
            if alone and cut.rows is not None and rnd.in_rows == g:
                if cut.rows_plan is None:  # the same views round after round: made once
                    cut.rows_plan = ring_rows_plan(cut.results, cut.rows)
                ring_reduce_rows_(cut.results, cut.rows, op, cut.rows_plan)
                mine = range(0)
            pieces = [rnd.pieces[m] for m in members]
            for c in mine:
                ring_reduce_position_([cut.result_pieces[b][c] for b in buffers],
                                      [[member[b][c] for b in buffers] for member in pieces], c, op)
        except BaseException as exc:
            self.abort(exc)
            raise
        with self._lock:
            rnd.reduced.update(members if alone else [rank])
            if len(rnd.reduced) == g:
                rnd.done = True
                self._poke(members)
            self._await(rank, lambda: rnd.done, lambda: set(members) - rnd.reduced)
        return list(rnd.result)

    def _cut_for(self, members: tuple[int, ...], shapes: tuple[_Shape, ...]) -> _Cut:
        """The cut of ``members``' all-reduce of flat buffers of ``shapes`` (holding the lock)."""
        cut = self._cuts.get((members, shapes))
        if cut is None:
            results = [torch.empty(n, dtype=dtype, device=device) for n, dtype, device in shapes]
            cut = self._cuts[members, shapes] = _Cut(results, [r.tensor_split(len(members)) for r in results])
        return cut

    def bucket_rows(self, members: tuple[int, ...], rank: int,
                    shapes: tuple[_Shape, ...]) -> list[torch.Tensor]:
        """Member ``rank``'s buffers of ``shapes`` for all-reducing among ``members`` round
        after round: its rows of one tensor per buffer that holds every member's. With fewer
        run slots than members the last member in then reduces every chunk of a buffer at
        once (:func:`ring_reduce_rows_`) instead of chunk by chunk."""
        with self._lock:
            cut = self._cut_for(members, shapes)
            if cut.rows is None:
                cut.rows = [torch.empty(len(members), n, dtype=dtype, device=device)
                            for n, dtype, device in shapes]
            return [rows[members.index(rank)] for rows in cut.rows]

    def check(self) -> None:
        """Raise :class:`NodeAborted` if a node of this cluster has failed."""
        with self._lock:
            self._check()

    def _check(self) -> None:
        if self._error is not None:
            raise NodeAborted(f"stopping: another node failed ({self._error!r})")


_Shape = tuple[int, torch.dtype, torch.device]  # a flat buffer's size, dtype and device


def _shapes(flats: Sequence[torch.Tensor]) -> tuple[_Shape, ...]:
    return tuple((f.numel(), f.dtype, f.device) for f in flats)


class _KeptBuckets:
    """A node's bucket buffers, kept from step to step, and views of them and of the
    all-reduce's results shaped like the bucket's tensors: filling the buffers and reading
    the results back are then one list copy each, not a reshape and a view per tensor."""

    def __init__(self, buffers: list[torch.Tensor], shapes: list[list[torch.Size]]) -> None:
        self.buffers = buffers
        self._shapes = shapes  # [b][i]: the shape of bucket b's tensor i
        self.filling = self._views(buffers)
        self._results: tuple[list[int], list[torch.Tensor]] = ([], [])

    def reading(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views of ``results`` (one flat tensor per bucket) shaped like the bucket's tensors;
        kept while the results are the same tensors (the hub keeps them round after round)."""
        addresses = [r.data_ptr() for r in results]
        if addresses != self._results[0]:
            self._results = (addresses, self._views(results))
        return self._results[1]

    def _views(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        views: list[torch.Tensor] = []
        for flat, shapes in zip(flats, self._shapes, strict=True):
            offset = 0
            for shape in shapes:
                views.append(flat[offset : offset + shape.numel()].view(shape))
                offset += shape.numel()
        return views


class ThreadCommunicator(Communicator):
    """A node's view of a :class:`ThreadHub`."""

    def __init__(self, hub: ThreadHub, rank: int) -> None:
        super().__init__(rank, hub.world_size)
        self.hub = hub
        self._sequence: dict[tuple[int, ...], int] = {}
        self._kept_buckets: dict[tuple[Any, ...], _KeptBuckets] = {}

    def _key(self, members: list[int]) -> tuple[tuple[int, ...], int]:
        group = tuple(members)
        seq = self._sequence.get(group, 0)
        self._sequence[group] = seq + 1
        return group, seq

    def _ring_all_reduce(self, flat: torch.Tensor, op: ReduceOp, members: list[int]) -> torch.Tensor:
        return self.hub.all_reduce(self._key(members), self.rank, [flat], op)[0]

    @_clocked
    def all_reduce_buckets(self, buckets: Sequence[Sequence[torch.Tensor]], op: ReduceOp = "mean",
                           group: Group | None = None, *, record: bool = True) -> None:
        # One meeting for every bucket (the nodes wait for each other once, not per bucket),
        # from the same buffers every step, so the hub cuts them into ring chunks only once.
        started = time.perf_counter()
        members = self.members(group)
        kept = self._kept_buckets_for(buckets, members)
        if len(members) > 1:
            tensors = [t for bucket in buckets for t in bucket]
            with torch.no_grad():
                torch._foreach_copy_(kept.filling, tensors)
                results = self.hub.all_reduce(self._key(members), self.rank, kept.buffers, op, kept=True)
                torch._foreach_copy_(tensors, kept.reading(results))
        if record:
            for flat in kept.buffers:
                self.log.add(self._all_reduce_record(flat, members, self.step))
            self.log.seconds += time.perf_counter() - started

    def _kept_buckets_for(self, buckets: Sequence[Sequence[torch.Tensor]],
                          members: list[int]) -> _KeptBuckets:
        """This node's buffers for buckets shaped like ``buckets`` (its rows of the hub's,
        :meth:`ThreadHub.bucket_rows`), with views shaped like the bucket's tensors."""
        signature = (tuple(members), tuple(tuple((t.shape, t.dtype, t.device) for t in bucket)
                                           for bucket in buckets))
        kept = self._kept_buckets.get(signature)
        if kept is None:
            if any(len({t.dtype for t in bucket}) > 1 for bucket in buckets):
                raise ValueError("all_reduce_buckets: a bucket holds tensors of several dtypes "
                                 "(cut buckets with bucket_layout, one dtype each)")
            shapes = tuple((sum(t.numel() for t in bucket), bucket[0].dtype, bucket[0].device)
                           for bucket in buckets)
            buffers = (self.hub.bucket_rows(tuple(members), self.rank, shapes) if len(members) > 1
                       else [torch.empty(n, dtype=dtype, device=device) for n, dtype, device in shapes])
            kept = self._kept_buckets[signature] = _KeptBuckets(
                buffers, [[t.shape for t in bucket] for bucket in buckets])
        return kept

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
        self.hub.take_turn(self.rank)  # at every step: the check, and the run slot's turns
