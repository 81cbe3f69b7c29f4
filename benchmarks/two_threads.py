"""How much do two cores give two Python threads? The runtimes benchmark's plain loop, alone,
in two threads of one process, and in two processes at once.

The threads runtime computes nodes in threads of one process; torch releases Python's
interpreter lock inside each operation, so two threads overlap only while one of them is
inside a kernel. For a small model whose step is mostly short operations and Python, that
bounds what a second core can give the threads runtime, whatever the runtime itself does.
Each copy runs the same work (the 4-replica DDP plain loop of ``benchmarks/runtimes.py``,
one torch thread); the table gives each copy's wall and CPU seconds, and the speed-up of
two copies at once over one copy done twice.

    python benchmarks/two_threads.py
    python benchmarks/two_threads.py --steps 300 --repeats 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import threading
import time

import torch
from rich.table import Table
from runtimes import _plain_loop, make_data, medians

from meshtrain.tables import print_fitted


def one_copy(steps: int) -> tuple[float, float]:
    """(wall, CPU seconds of this thread) of one plain loop."""
    data = make_data()
    wall, cpu = time.perf_counter(), time.thread_time()
    _plain_loop(data, "ddp", steps, 20)
    return time.perf_counter() - wall, time.thread_time() - cpu


def _in_process(steps: int, results: mp.Queue) -> None:  # type: ignore[type-arg]
    torch.set_num_threads(1)
    one_copy(5)  # warm-up
    results.put(one_copy(steps))


def two_threads(steps: int) -> list[tuple[float, float]]:
    results: list[tuple[float, float]] = []
    threads = [threading.Thread(target=lambda: results.append(one_copy(steps))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def two_processes(steps: int) -> list[tuple[float, float]]:
    ctx = mp.get_context("fork")  # the benchmark's own process: torch is imported already
    results: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [ctx.Process(target=_in_process, args=(steps, results)) for _ in range(2)]
    for p in procs:
        p.start()
    out = [results.get() for _ in procs]
    for p in procs:
        p.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3, help="samples of each row (median)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    one_copy(5)  # warm-up
    rows: dict[str, list[tuple[float, float]]] = {"one copy alone": [], "two threads at once": [],
                                                  "two processes at once": []}
    for _ in range(args.repeats):  # interleaved: each sample sees the same machine
        rows["one copy alone"].append(one_copy(args.steps))
        rows["two threads at once"] += two_threads(args.steps)
        rows["two processes at once"] += two_processes(args.steps)
    alone, _ = medians(rows["one copy alone"])
    table = Table(title=f"the plain 4-replica DDP loop, {args.steps} steps, 1 torch thread, median of "
                        f"{args.repeats} (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    for column in ("", "wall per copy", "CPU per copy", "speed-up of two at once"):
        table.add_column(column, justify="right")
    for name, samples in rows.items():
        wall, cpu = medians(samples)
        speedup = "" if name == "one copy alone" else f"{2 * alone / wall:.2f}x"
        table.add_row(name, f"{wall:.2f} s", f"{cpu:.2f} s", speedup)
    print_fitted(table, piped_width=140)


if __name__ == "__main__":
    main()
