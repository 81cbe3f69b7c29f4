"""meshtrain's all-reduce against gloo's own ``dist.all_reduce``, on loopback.

N gloo processes (2 by default) on 127.0.0.1, one torch thread each, each pinned to
one core (rank r on core r mod cores). For every message size the two all-reduces
(sum of float32) alternate, A B A B ..., each timed on every rank after a barrier;
a sample is the slowest rank's time, and the table shows the medians and their
ratio. Alternating both in one run makes the ratio hold on a loaded machine, where
absolute times do not.

    python benchmarks/collective.py               # 2 processes, 64 KB .. 16 MB
    python benchmarks/collective.py --nodes 4 --repeats 10
    python benchmarks/collective.py --back-to-back 30   # 30 calls after each barrier

One call after a barrier is the latency of a lone collective; ``--back-to-back`` is a
strategy that reduces tensor by tensor (the next call starts as the last one ends).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

from meshtrain.comm import torch_dist
from meshtrain.comm.torch_dist import TorchDistCommunicator, host_loopback_store, init_process_group
from meshtrain.tables import print_fitted

SIZES = [64 * 2**10, 256 * 2**10, 2**20, 1_680_000, 4 * 2**20, 16 * 2**20]


def _timed(fn, flat: torch.Tensor, calls: int = 1) -> float:  # noqa: ANN001 - a benchmark helper
    """Seconds per call of ``calls`` calls back to back after a barrier, on the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn(flat)
    elapsed = torch.tensor([(time.perf_counter() - start) / calls], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time is the collective's
    return float(elapsed)


def _rank(rank: int, nodes: int, port: int, repeats: int, sizes: list[int], piece_bytes: int,
          kept_scratch: int, calls: int, results: object) -> None:
    torch_dist.PIECE_BYTES = piece_bytes
    torch_dist.KEPT_SCRATCH_BYTES = kept_scratch
    torch.set_num_threads(1)
    cores = os.cpu_count() or 1
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {rank % cores})
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    init_process_group(rank, nodes, "127.0.0.1", port, torch.device("cpu"), 120.0, external_store=True)
    comm = TorchDistCommunicator()

    def meshtrain_all_reduce(t: torch.Tensor) -> None:
        comm.all_reduce(t, op="sum")

    def gloo_all_reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)

    rows = []
    for nbytes in sizes:
        flat = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank))
        for fn in (meshtrain_all_reduce, gloo_all_reduce):  # warm-up (connections, buffers)
            _timed(fn, flat)
        ours, theirs = [], []
        for _ in range(repeats):
            ours.append(_timed(meshtrain_all_reduce, flat, calls))
            theirs.append(_timed(gloo_all_reduce, flat, calls))
        rows.append((nbytes, statistics.median(ours), statistics.median(theirs)))
    if rank == 0:
        results.put(rows)  # type: ignore[attr-defined]
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15, help="samples of each (median)")
    parser.add_argument("--sizes", type=int, nargs="*", default=SIZES, help="message sizes in bytes")
    parser.add_argument("--piece-bytes", type=int, default=torch_dist.PIECE_BYTES,
                        help="meshtrain's ring message size (default: the library's)")
    parser.add_argument("--kept-scratch-bytes", type=int, default=torch_dist.KEPT_SCRATCH_BYTES,
                        help="receive space the ring keeps between calls (default: the library's; 0: none)")
    parser.add_argument("--back-to-back", type=int, default=1, metavar="CALLS",
                        help="a sample is CALLS all-reduces back to back after one barrier (per call)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store, port = host_loopback_store(120.0)
    procs = [ctx.Process(target=_rank, args=(r, args.nodes, port, args.repeats, args.sizes,
                                                     args.piece_bytes, args.kept_scratch_bytes,
                                                     args.back_to_back, results))
             for r in range(args.nodes)]
    load_before = os.getloadavg()[0]
    for p in procs:
        p.start()
    rows = results.get()
    for p in procs:
        p.join()
    del store
    console = Console(width=140)
    console.print(f"all-reduce (sum, float32), {args.nodes} gloo processes on loopback, 1 thread each; "
                  f"median of {args.repeats} alternating samples of {args.back_to_back} call(s) "
                  "back to back; "
                  f"ring pieces of {args.piece_bytes} bytes; "
                  f"{args.kept_scratch_bytes} bytes of scratch kept; "
                  f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    table = Table()
    for col in ("message", "meshtrain ms", "dist.all_reduce ms", "meshtrain / gloo"):
        table.add_column(col, justify="right")
    for nbytes, ours, theirs in rows:
        table.add_row(f"{nbytes / 1e6:.3f} MB", f"{ours * 1e3:.2f}", f"{theirs * 1e3:.2f}",
                      f"{ours / theirs:.2f}x")
    print_fitted(table, piped_width=140)


if __name__ == "__main__":
    main()
