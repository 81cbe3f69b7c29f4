"""Gradients all-reduced as a few buckets, on the wire while the backward pass still runs
where the communicator allows it.

The buckets are cut once from the parameter list: in reverse registration order (the
backward pass produces the last layers' gradients first), a new bucket once one holds
:data:`BUCKET_BYTES`. Every runtime all-reduces the same buckets, so the ring's chunk
boundaries (which decide the summation order among more than two nodes) and the bytes
are the same on threads, processes, real hosts and vmap.

Where the communicator can reduce from a second thread (torch.distributed over gloo) and
the training loop says the coming backward pass is the step's only one
(:meth:`GradientBuckets.start_during_backward`), a bucket goes on the wire as soon as the
backward pass has produced all its gradients (post-accumulate-grad hooks): one worker
thread runs its ring while the node's thread goes on with the backward pass. Buckets are
posted in bucket order, the last (which carries the has-gradient flags) once the backward
pass is over, so every rank posts the same collectives in the same order. The node's
thread posts no collective of its own until :meth:`GradientBuckets.all_reduce_` has
waited for every bucket: two threads never use the group at once.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from meshtrain.comm.communicator import (
    Communicator,
    Group,
    ReduceOp,
    _flatten,
    _unflatten_into,
    start_worker,
)

#: Bytes of gradients per bucket (at least; a larger tensor is a bucket of its own): small
#: enough that the first buckets leave early in the backward pass, large enough that the
#: cost per message stays small.
BUCKET_BYTES = 256 * 2**10


def bucket_layout(sizes: Sequence[int], cap: int = BUCKET_BYTES,
                  kinds: Sequence[Hashable] | None = None) -> list[list[int]]:
    """The tensors of ``sizes`` (bytes each), by index, bucket by bucket: from the last
    tensor to the first, a new bucket once the current one holds ``cap`` bytes.

    ``kinds`` (the tensors' dtypes, say) keeps tensors of different kinds apart, as torch DDP
    does: each kind fills its own bucket, so a bucket is sent at its own width (one flat
    buffer of two dtypes would carry the narrow one widened). The bucket holding tensor 0
    comes last (riders take its dtype), the other unfilled ones just before it. Always at
    least one bucket (with no tensors an empty one: it carries what rides along)."""
    kinds = kinds if kinds is not None else [None] * len(sizes)
    buckets: list[list[int]] = []
    filling: dict[Hashable, tuple[list[int], int]] = {}  # kind -> (its open bucket, bytes held)
    for i in reversed(range(len(sizes))):
        current, held = filling.pop(kinds[i], ([], 0))
        current.append(i)
        if held + sizes[i] >= cap:
            buckets.append(current)
        else:
            filling[kinds[i]] = (current, held + sizes[i])
    buckets += [current for current, _ in filling.values()]
    # Tensor 0's bucket (0 is the last index any bucket took) goes last: riders take its dtype.
    with_first = next((b for b in buckets if b[-1] == 0), None)
    if with_first is not None:
        buckets.remove(with_first)
        buckets.append(with_first)
    return buckets or [[]]


@dataclass
class _Flight:
    """One step's buckets on their way through the worker."""

    step: int
    op: ReduceOp
    scale: float | None
    members: list[int]
    pending: list[int]  # gradients each bucket still waits for
    posted: int = 0  # buckets handed to the worker, in order
    done: int = 0  # buckets the worker has finished (or skipped after an error)
    reduced: dict[int, torch.Tensor] = field(default_factory=dict)
    error: BaseException | None = None
    ready: threading.Condition = field(default_factory=threading.Condition)


class GradientBuckets:
    """All-reduce of one gradient per parameter of ``params``, bucket by bucket.

    ``nodes``: the vmap runtime's stacked node count (sizes are per node).
    """

    def __init__(self, comm: Communicator, params: Sequence[torch.Tensor], *,
                 nodes: int | None = None, cap: int = BUCKET_BYTES) -> None:
        self.comm = comm
        self.params = list(params)
        self.layout = bucket_layout([p.numel() // (nodes or 1) * p.element_size() for p in self.params], cap,
                                    kinds=[(p.dtype, p.device) for p in self.params])
        self._bucket_of = {i: b for b, indices in enumerate(self.layout) for i in indices}
        self._flight: _Flight | None = None
        self._sole_backward = False  # this step's buckets but the last may hide behind backward
        self._jobs: queue.SimpleQueue[Callable[[], None]] | None = None
        if comm.reduces_in_background:
            for i, p in enumerate(self.params):
                p.register_post_accumulate_grad_hook(functools.partial(self._gradient_ready, i))

    def start_during_backward(self, step: int, *, op: ReduceOp, scale: float | None,
                              group: Group | None = None) -> None:
        """The coming backward pass produces this step's final gradients and
        :meth:`all_reduce_` (with the same ``op`` and ``scale``) follows it with no
        collective in between: send each bucket as soon as its gradients are ready.
        Where the communicator cannot reduce in the background, the buckets wait for
        :meth:`all_reduce_`, but their records still say which ones a launched run
        overlaps (the projection hides them behind the backward pass)."""
        self._sole_backward = True
        members = self.comm.members(group)
        if not self.comm.reduces_in_background or len(members) < 2:
            return
        if self._jobs is None:
            self._jobs = start_worker("meshtrain-gradient-buckets")
        self._flight = _Flight(step, op, scale, members, [len(b) for b in self.layout])

    @torch.no_grad()
    def all_reduce_(self, tensors: Sequence[torch.Tensor], *, op: ReduceOp, scale: float | None = None,
                    along: Sequence[torch.Tensor] = (), group: Group | None = None,
                    record: bool = True) -> None:
        """Reduce ``tensors`` (one per parameter, in order) in place, bucket by bucket;
        ``along`` rides in the last bucket. With ``scale``, ``tensors`` (not ``along``)
        are multiplied by it before they are reduced."""
        flight, self._flight = self._flight, None
        sole_backward, self._sole_backward = self._sole_backward, False
        if flight is not None:
            asked = (op, scale, self.comm.members(group), record)
            if asked != (flight.op, flight.scale, flight.members, True):
                raise RuntimeError("gradient buckets started during backward for another reduction")
            self._land(flight, tensors, along)
            return
        if scale is not None:
            for t in tensors:
                t.mul_(scale)
        last = len(self.layout) - 1
        buckets = [[*(tensors[i] for i in indices), *(along if b == last else ())]
                   for b, indices in enumerate(self.layout)]
        self.comm.all_reduce_buckets(buckets, op=op, group=group, record=record)
        if record and sole_backward:
            # As the overlapped path records it (the last bucket leaves after backward).
            records = self.comm.log.records
            for r in range(len(records) - len(buckets), len(records) - 1):
                records[r] = dataclasses.replace(records[r], during_backward=True)

    # ------------------------------------------------------------ overlapped path
    def _gradient_ready(self, index: int, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: the bucket of parameter ``index`` may be complete."""
        flight = self._flight
        if flight is None:
            return
        with flight.ready:
            bucket = self._bucket_of[index]
            flight.pending[bucket] -= 1
            if flight.pending[bucket] < 0 and flight.error is None:
                flight.error = RuntimeError(
                    "a gradient was accumulated twice in one backward pass after its bucket had left")
            # In bucket order; the last bucket waits for the flags, after the backward pass.
            while flight.posted < len(self.layout) - 1 and flight.pending[flight.posted] == 0:
                indices = self.layout[flight.posted]
                self._post(flight, flight.posted, [self.params[i].grad for i in indices], ())  # type: ignore[misc]
                flight.posted += 1

    def _land(self, flight: _Flight, tensors: Sequence[torch.Tensor], along: Sequence[torch.Tensor]) -> None:
        """Post the buckets still here, wait for every bucket, write the results back."""
        clock = self.comm.collective_clock
        started, clocked = time.perf_counter(), clock() if clock is not None else 0.0
        last = len(self.layout) - 1
        with flight.ready:
            for b in range(flight.posted, last + 1):
                self._post(flight, b, [tensors[i] for i in self.layout[b]], along if b == last else ())
            flight.posted = last + 1
            flight.ready.wait_for(lambda: flight.done == len(self.layout))
        if flight.error is not None:
            raise flight.error
        for b, indices in enumerate(self.layout):
            riding = along if b == last else ()
            _unflatten_into(flight.reduced[b], [*(tensors[i] for i in indices), *riding])
        # Only the wait after the backward pass is communication the node's step sees.
        self.comm.log.seconds += time.perf_counter() - started
        if clock is not None:
            self.comm.collective_clock_seconds += clock() - clocked

    def _post(self, flight: _Flight, bucket: int, tensors: list[torch.Tensor],
              along: Sequence[torch.Tensor]) -> None:
        assert self._jobs is not None
        self._jobs.put(functools.partial(self._reduce, flight, bucket, tensors, list(along)))

    def _reduce(self, flight: _Flight, bucket: int, tensors: list[torch.Tensor],
                along: list[torch.Tensor]) -> None:
        """On the worker: fill the bucket (the gradients are final) and all-reduce it."""
        try:
            if flight.error is None:
                flat = _flatten([*tensors, *along])
                if flight.scale is not None:  # the same product, element by element, as t.mul_(scale)
                    flat[: sum(t.numel() for t in tensors)].mul_(flight.scale)
                early = bucket < len(self.layout) - 1  # left while the backward pass ran
                flight.reduced[bucket] = self.comm.all_reduce_bucket(
                    flat, flight.op, flight.members, flight.step, during_backward=early)
        except BaseException as exc:  # handed to the node's thread, which raises it
            flight.error = exc
        finally:
            with flight.ready:
                flight.done += 1
                flight.ready.notify_all()
