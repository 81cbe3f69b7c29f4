"""Communicator backends: ThreadHub collectives and torch.distributed over gloo."""

from __future__ import annotations

import io
import multiprocessing as mp
import threading
import time
from queue import Empty

import pytest
import torch
from helpers import ORDER_VALUES, RETIRE_WORLD, comm_script, gloo_comm_worker, gloo_retire_worker
from torch.testing import assert_close

from meshtrain.comm import (
    NodeAborted,
    ThreadCommunicator,
    ThreadHub,
    ring_all_reduce_bytes,
    ring_reduce,
    threads,
)
from meshtrain.comm.communicator import ring_reduce_rows_, ring_rows_plan
from meshtrain.comm.torch_dist import backend_for
from meshtrain.engine.runtimes.processes import free_loopback_port


def on_threads(world: int, fn, timeout: float = 30.0, slots: int | None = None) -> list:
    """Run ``fn(comm)`` on every node of a fresh hub, one thread each; results by rank."""
    hub = ThreadHub(world, slots=slots)
    results: list = [None] * world
    errors: list = [None] * world

    def main(rank: int) -> None:
        try:
            results[rank] = fn(ThreadCommunicator(hub, rank))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[rank] = exc
            hub.abort(exc)

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a node hung"
    for e in errors:
        if e is not None:
            raise e
    return results


def inputs(world: int, numel: int = 1001) -> list[torch.Tensor]:
    return [torch.randn(numel, generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("op", ["mean", "sum", "max"])
def test_thread_all_reduce_matches_ring_order(world, op):
    xs = inputs(world)
    out = on_threads(world, lambda c: _reduced(c, xs[c.rank], op))
    expected = ring_reduce(xs, op)
    for r in range(world):
        assert torch.equal(out[r], expected)
    reference = {"mean": torch.stack(xs).mean(0), "sum": torch.stack(xs).sum(0),
                 "max": torch.stack(xs).max(0).values}[op]
    assert_close(expected, reference)


def _reduced(comm, x, op, group=None):
    t = x.clone()
    comm.all_reduce(t, op=op, group=group)
    return t


def test_ring_reduce_starts_chunk_c_at_position_c():
    # float32: 1e8 + 1 == 1e8, so only the chunk whose sum starts at -1e8 + 1e8 keeps the 1.
    xs = [torch.full((3,), v, dtype=torch.float32) for v in ORDER_VALUES]
    assert ring_reduce(xs, "sum").tolist() == [0.0, 0.0, 1.0]
    out = on_threads(3, lambda c: _reduced(c, xs[c.rank], "sum"))
    assert all(o.tolist() == [0.0, 0.0, 1.0] for o in out)


def test_thread_all_reduce_bucket_of_tensors_in_place():
    world = 3
    g = torch.Generator().manual_seed(0)
    per_node = [[torch.randn(3, 5, generator=g), torch.randn(7, generator=g)] for _ in range(world)]
    originals = [[t.clone() for t in ts] for ts in per_node]

    def fn(comm):
        comm.all_reduce(per_node[comm.rank], op="mean")
        return comm.log.records

    logs = on_threads(world, fn)
    flat = ring_reduce([torch.cat([t.reshape(-1) for t in ts]) for ts in originals], "mean")
    for r in range(world):
        assert torch.equal(torch.cat([t.reshape(-1) for t in per_node[r]]), flat)
        assert per_node[r][0].shape == (3, 5)
        (record,) = logs[r]  # one collective for the whole bucket
        assert (record.kind, record.group_size) == ("all_reduce", 3)
        assert (record.bytes_sent, record.bytes_received) == ring_all_reduce_bytes(22, 4, r, 3)


def test_thread_all_gather_and_broadcast():
    world = 4
    xs = inputs(world, 6)

    def fn(comm):
        gathered = comm.all_gather(xs[comm.rank])
        b = xs[comm.rank].clone()
        comm.broadcast(b, src=2)
        return gathered, b, comm.log.records

    for r, (gathered, b, records) in enumerate(on_threads(world, fn)):
        assert len(gathered) == world
        assert all(torch.equal(g, x) for g, x in zip(gathered, xs, strict=True))
        assert torch.equal(b, xs[2])
        assert records[0].kind == "all_gather" and records[0].bytes_sent == 3 * 6 * 4
        sent = 3 * 6 * 4 if r == 2 else 0
        assert (records[1].kind, records[1].bytes_sent, records[1].bytes_received) == (
            "broadcast", sent, 0 if r == 2 else 6 * 4)


def test_gathered_tensors_are_copies():
    def fn(comm):
        x = torch.full((2,), float(comm.rank))
        gathered = comm.all_gather(x)
        x.add_(100)  # the caller reuses its buffer
        comm.all_reduce(torch.zeros(1))  # a barrier: everyone has modified its x by now
        return gathered

    for gathered in on_threads(3, fn):
        assert [g.tolist() for g in gathered] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]


def test_each_member_reduces_its_own_ring_chunk(monkeypatch):
    """The in-process all-reduce is shared out as a ring's is: node at position c sums chunk c
    (no node sums every buffer), and the result is still ring_reduce's bit for bit."""
    import meshtrain.comm.threads as threads_backend

    world, xs = 5, inputs(5, 1003)  # 1003 does not split evenly: chunks of 201 and 200
    reduced_by: dict[str, list[int]] = {}
    real = threads_backend.ring_reduce_position_

    def recording(outs, chunks, c, op):
        reduced_by.setdefault(threading.current_thread().name, []).append(c)
        real(outs, chunks, c, op)

    monkeypatch.setattr(threads_backend, "ring_reduce_position_", recording)

    def fn(comm):
        threading.current_thread().name = f"node-{comm.rank}"
        return _reduced(comm, xs[comm.rank], "mean")

    out = on_threads(world, fn)
    assert reduced_by == {f"node-{r}": [r] for r in range(world)}
    for r in range(world):
        assert torch.equal(out[r], ring_reduce(xs, "mean"))


@pytest.mark.parametrize("slots", [None, 2], ids=["every-node-at-once", "2-run-slots"])
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_buckets_in_one_meeting_equal_one_all_reduce_each(op, slots, monkeypatch):
    """all_reduce_buckets on threads (one meeting, every bucket's chunk c summed in one list
    operation; with fewer slots than nodes the last one in reduces each bucket from the
    members' rows at once) gives each bucket's own ring reduction, bit for bit, and one
    record each."""
    world, sizes = 5, (1003, 7, 250, 3)  # uneven chunks, and a bucket smaller than the ring
    by_rows = []
    monkeypatch.setattr(threads, "ring_reduce_rows_",
                        lambda outs, rows, op, plan: (by_rows.extend(r.shape for r in rows),
                                                      ring_reduce_rows_(outs, rows, op, plan)))
    xs = [[torch.randn(n, generator=torch.Generator().manual_seed(100 * r + n)) for n in sizes]
          for r in range(world)]

    def fn(comm):
        if slots is not None:
            comm.hub.take_slot(comm.rank)
        try:
            rounds = []
            for scale in (1.0, -3.0):  # a second round reuses the buffers and their cut
                buckets = [[x.clone() * scale] for x in xs[comm.rank]]
                comm.all_reduce_buckets(buckets, op=op)
                rounds.append([b[0] for b in buckets])
            return rounds, comm.log.records
        finally:
            comm.hub.give_slot(comm.rank)

    for rank, (rounds, records) in enumerate(on_threads(world, fn, slots=slots)):
        for scale, reduced in zip((1.0, -3.0), rounds, strict=True):
            for b in range(len(sizes)):
                expected = ring_reduce([x[b] * scale for x in xs], op)
                assert torch.equal(reduced[b], expected), (rank, scale, b)
        assert [r.bytes_sent for r in records] == [
            ring_all_reduce_bytes(n, 4, rank, world)[0] for n in sizes] * 2
    assert by_rows == ([] if slots is None else [(world, n) for n in sizes] * 2)


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("g,n", [(2, 9), (3, 7), (4, 4), (5, 3), (5, 1003), (64, 100_003), (64, 65_536)])
def test_ring_reduce_of_rows_is_the_ring_reduction_bit_for_bit(g, n, op):
    rows = torch.randn(g, n, generator=torch.Generator().manual_seed(g * n))
    rows[:, ::7] *= 1e8  # large and small values: a different order of additions shows
    out = torch.empty(n)
    ring_reduce_rows_([out], [rows], op)
    assert torch.equal(out, ring_reduce(list(rows), op))


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_ring_reduce_of_several_buffers_rows_at_once_is_each_ones_ring_reduction(op):
    """Buffers of different sizes (one smaller than the ring) reduced in one pass, with
    the plan's views made once and used again for new values, bit for bit."""
    g, sizes = 6, (1003, 4, 6, 65_537)
    rows = [torch.empty(g, n) for n in sizes]
    outs = [torch.empty(n) for n in sizes]
    plan = ring_rows_plan(outs, rows)
    for seed in (1, 2):
        for stacked in rows:
            stacked.copy_(torch.randn(stacked.shape, generator=torch.Generator().manual_seed(seed)))
            stacked[:, ::7] *= 1e8
        ring_reduce_rows_(outs, rows, op, plan)
        for out, stacked in zip(outs, rows, strict=True):
            assert torch.equal(out, ring_reduce(list(stacked), op))


def test_two_disjoint_groups_reduce_concurrently():
    world = 4
    xs = inputs(world, 101)
    groups = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}
    arrived = threading.Barrier(world)

    def fn(comm):
        arrived.wait()  # both groups are in flight at once
        out = []
        for op in ("sum", "max"):
            out.append(_reduced(comm, xs[comm.rank], op, group=groups[comm.rank]))
        return out, comm.log.records

    for r, (out, records) in enumerate(on_threads(world, fn)):
        members = groups[r]
        assert torch.equal(out[0], ring_reduce([xs[m] for m in members], "sum"))
        assert torch.equal(out[1], ring_reduce([xs[m] for m in members], "max"))
        assert all(rec.group_size == 2 for rec in records)


def test_group_without_this_rank_is_rejected():
    def fn(comm):
        if comm.rank == 0:
            with pytest.raises(ValueError, match="not in group"):
                comm.all_reduce(torch.zeros(2), group=[1])
        return True

    assert on_threads(2, fn) == [True, True]


def test_abort_wakes_every_waiting_node():
    hub = ThreadHub(3)
    errors: list = []

    def waiter(rank):
        try:
            ThreadCommunicator(hub, rank).all_reduce(torch.zeros(4))
        except NodeAborted as exc:
            errors.append(exc)

    threads = [threading.Thread(target=waiter, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    started = time.monotonic()
    hub.abort(RuntimeError("node 2 died"))
    for t in threads:
        t.join(5)
    assert time.monotonic() - started < 2
    assert len(errors) == 2 and all("node 2 died" in str(e) for e in errors)
    with pytest.raises(NodeAborted):  # and later collectives fail at once
        ThreadCommunicator(hub, 2).all_reduce(torch.zeros(4))


def test_single_node_collectives_are_free_and_unchanged():
    comm = ThreadCommunicator(ThreadHub(1), 0)
    x = torch.randn(5)
    y = x.clone()
    comm.all_reduce(y, op="mean")
    assert torch.equal(x, y)
    assert torch.equal(comm.all_gather(x)[0], x)
    assert comm.log.bytes_sent == comm.log.bytes_received == 0
    assert [r.group_size for r in comm.log.records] == [1, 1]


def test_unrecorded_collectives_leave_the_log_alone():
    def fn(comm):
        comm.all_reduce(torch.ones(8), record=False)
        comm.all_gather(torch.ones(8), record=False)
        return comm.log.records, comm.log.bytes_sent

    assert on_threads(2, fn) == [([], 0), ([], 0)]


# ------------------------------------------------------------------------- gloo
@pytest.fixture(scope="module")
def gloo_results():
    return comm_script_on_gloo(3)


def comm_script_on_gloo(world: int, backend: str | None = None) -> list[dict]:
    """:func:`comm_script`'s results from ``world`` spawned gloo processes, by rank (their
    group made with ``backend``, if given, instead of meshtrain's choice)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_loopback_port()
    procs = [ctx.Process(target=gloo_comm_worker, args=(r, world, port, queue, backend), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        got: dict[int, bytes] = {}
        deadline = time.monotonic() + 90
        while len(got) < world:  # a worker that died fails the fixture now, not at the deadline
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            assert not dead, f"gloo workers (rank, exit code) died: {dead}"
            missing = set(range(world)) - set(got)
            assert time.monotonic() < deadline, f"gloo workers still missing after 90 s: {missing}"
            try:
                rank, data = queue.get(timeout=0.2)
            except Empty:
                continue
            got[rank] = data
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [torch.load(io.BytesIO(got[r]), weights_only=False) for r in range(world)]


def test_gloo_bit_identical_to_threads(gloo_results):
    threads = on_threads(3, comm_script)
    for rank, (gloo, thread) in enumerate(zip(gloo_results, threads, strict=True)):
        assert gloo.keys() == thread.keys()
        for key in gloo:
            if key == "wire":
                continue
            a, b = gloo[key], thread[key]
            if isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
                assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (rank, key)
            elif isinstance(a, torch.Tensor):
                assert torch.equal(a, b), (rank, key)
            else:
                assert a == b, (rank, key)
    # The ring order shows in float32: [0, 0, 1], not the naive sum's 1 everywhere or 0 everywhere.
    assert gloo_results[0]["order"].tolist() == [0.0, 0.0, 1.0]
    # Results are the reduction of every node's random data.
    xs = inputs(3)
    assert torch.equal(gloo_results[1]["all_reduce_sum"], ring_reduce(xs, "sum"))
    assert torch.equal(gloo_results[0]["group"], ring_reduce([xs[0], xs[2]], "sum"))
    assert "group" not in gloo_results[1]
    assert gloo_results[1]["all_gather_int16"].dtype == torch.int16


def test_cpu_tensors_of_a_cuda_rank_go_through_gloo_as_on_a_cpu_rank(gloo_results):
    """A rank on CUDA joins with ``cpu:gloo,cuda:nccl`` (nccl alone refuses the CPU tensors
    every run sends: the non-finite vote, progress numbers, weight hashes, each node's
    report). Its communicator must treat CPU tensors exactly as on a gloo-only group. This
    machine's torch has no nccl, so the group here is ``cpu:gloo``: the same CPU half."""
    assert backend_for(torch.device("cuda")) == "cpu:gloo,cuda:nccl"
    assert backend_for(torch.device("cpu")) == backend_for(torch.device("mps")) == "gloo"
    mixed = comm_script_on_gloo(3, backend="cpu:gloo")
    for rank, (ours, plain) in enumerate(zip(mixed, gloo_results, strict=True)):
        assert ours.keys() == plain.keys()
        for key in ours:
            a, b = ours[key], plain[key]
            if isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
                assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (rank, key)
            elif isinstance(a, torch.Tensor):
                assert torch.equal(a, b), (rank, key)
            else:  # the bytes on the wire too: the same pipelined ring, not the stepwise one
                assert a == b, (rank, key)


def test_two_gloo_processes_sum_with_gloos_all_reduce_bit_identical_to_threads():
    """With two members each element of a sum is one addition, and a + b == b + a: the
    gloo communicator then hands sums and means to gloo's own all-reduce (not one message
    of its ring) and the results still equal the threads runtime's bit for bit. A max
    still goes round the ring (torch.maximum's NaN rule, not gloo's)."""
    gloo = comm_script_on_gloo(2)
    threads = on_threads(2, comm_script)
    for rank, (ours, thread) in enumerate(zip(gloo, threads, strict=True)):
        for key in ("all_reduce_mean", "all_reduce_sum", "all_reduce_max", "group",
                    "all_reduce_float64", "all_reduce_grown"):
            assert torch.equal(ours[key], thread[key]), (rank, key)
        assert all(torch.equal(x, y) for x, y in zip(ours["bucket"], thread["bucket"], strict=True))
        mean, total, largest = ours["wire"][:3]
        assert mean == total == (0, 0), rank  # gloo's all-reduce: no message of the ring
        assert largest == ring_all_reduce_bytes(1001, 4, rank, 2), rank
        assert ours["log"] == thread["log"], rank  # the same bytes recorded either way
    assert torch.equal(gloo[0]["all_reduce_sum"], ring_reduce(inputs(2), "sum"))


def test_gloo_recorded_bytes_are_the_bytes_on_the_wire(gloo_results):
    for rank, result in enumerate(gloo_results):
        recorded = [(s, r) for kind, s, r, _ in result["log"][:3]]  # the three all-reduces
        recorded.append(tuple(result["log"][4][1:3]))  # the float all-gather
        assert result["wire"] == recorded, rank
        assert recorded[0] == ring_all_reduce_bytes(1001, 4, rank, 3)


def test_gloo_keeps_finished_requests_one_call_and_never_a_large_one():
    """A finished gloo request is kept alive until the next collective (freed at once, it
    spins until gloo's network thread lets its buffer go: ~2 ms per exchange back to back;
    benchmarks/collective.py --back-to-back), but never one whose tensors hold more than
    RETIRED_BYTES: a model-sized buffer does not outlive its collective. Results stay exact."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_loopback_port()
    procs = [ctx.Process(target=gloo_retire_worker, args=(r, port, queue), daemon=True)
             for r in range(RETIRE_WORLD)]
    for p in procs:
        p.start()
    try:
        reports = dict(queue.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for rank, report in reports.items():
        assert all(exact for _, exact, _ in report), (rank, report)
        for what, _, kept in report:
            large = int(what.split()[1]) > 1_000_000
            assert (kept == 0) if large else (kept > 0), (rank, what, kept)


def test_node_reports_are_capped_at_64_mib_before_rank_0_allocates_them() -> None:
    """Nodes report to rank 0 as JSON in byte tensors, never pickled. A report over
    64 MiB is refused by its sender; and a hostile node that announces a bigger one is
    refused by rank 0 from the announced size, before a buffer of that size exists."""
    from meshtrain.comm.communicator import MAX_JSON_BYTES

    assert MAX_JSON_BYTES == 64 * 2**20

    def honest_but_too_big(comm):
        return comm.gather_json("x" * MAX_JSON_BYTES)  # 64 MiB + the two quotes

    with pytest.raises(ValueError, match=f"report of {MAX_JSON_BYTES + 2} bytes exceeds {MAX_JSON_BYTES}"):
        on_threads(1, honest_but_too_big)

    def hostile(comm):
        if comm.rank == 0:
            return comm.gather_json({"loss": 1.0})
        comm.all_gather(torch.tensor([2**40], dtype=torch.int64), record=False)  # announces 1 TiB
        comm.all_gather(torch.zeros(1, dtype=torch.uint8), record=False)

    with pytest.raises(ValueError, match=f"a node's report of {2**40} bytes exceeds {MAX_JSON_BYTES}"):
        on_threads(2, hostile)
