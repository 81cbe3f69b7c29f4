"""What do the threads runtime's meetings cost? Node threads meeting through a ThreadHub.

Each of ``--nodes`` threads does a little torch work (three 32x784 @ 784x128 products and
their backward pass, about as long as one node-step of the runtimes benchmark's MLP), then
meets the others (:meth:`ThreadHub.exchange`, no data), ``--meetings`` times, with 1 and 2
run slots; against the same work done one node after another in one thread. ``--hub-from
DIR`` also times the hub of another checkout (``DIR/meshtrain/comm/threads.py``, e.g. a
``git worktree`` of an older commit) in the same process, alternating with this one, so both
see the same machine.

    python benchmarks/hub_meetings.py
    git worktree add /tmp/before HEAD~1 && python benchmarks/hub_meetings.py --hub-from /tmp/before
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType

import torch
from rich.table import Table
from runtimes import medians

import meshtrain.comm.threads as this_hub
from meshtrain.tables import print_fitted


def other_hub(checkout: str) -> ModuleType:
    path = os.path.join(checkout, "meshtrain", "comm", "threads.py")
    spec = importlib.util.spec_from_file_location("other_threads", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules["other_threads"] = module
    spec.loader.exec_module(module)
    return module


def make_work() -> Callable[[], None]:
    weight = torch.randn(784, 128, requires_grad=True)
    x = torch.randn(32, 784)

    def work() -> None:
        for _ in range(3):
            (x @ weight).relu().sum().backward()

    return work


def meetings(hub_module: ModuleType, nodes: int, slots: int, count: int,
             work: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process) for ``count`` meetings of ``nodes`` threads."""
    hub = hub_module.ThreadHub(nodes, timeout_s=60, slots=slots)
    members = tuple(range(nodes))

    def node(rank: int) -> None:
        hub.take_slot(rank)
        try:
            for sequence in range(count):
                work()
                hub.exchange((members, sequence), rank, None, lambda _: None)
        finally:
            hub.give_slot(rank)

    threads = [threading.Thread(target=node, args=(rank,)) for rank in range(nodes)]
    wall, cpu = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - wall, time.process_time() - cpu


def one_after_another(nodes: int, count: int, work: Callable[[], None]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(count * nodes):
        work()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--meetings", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=6, help="samples of each cell (median)")
    parser.add_argument("--hub-from", metavar="DIR", help="also time the hub of this checkout")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each node of the threads runtime by default
    work = make_work()
    hubs = {"this hub": this_hub}
    if args.hub_from:
        hubs[f"hub of {args.hub_from}"] = other_hub(args.hub_from)
    kinds: dict[str, Callable[[], tuple[float, float]]] = {
        "one after another": lambda: one_after_another(args.nodes, args.meetings, work)}
    def timing(module: ModuleType, slots: int) -> Callable[[], tuple[float, float]]:
        return lambda: meetings(module, args.nodes, slots, args.meetings, work)

    for name, module in hubs.items():
        for slots in (1, 2):
            kinds[f"{name}, {slots} slot{'s' if slots > 1 else ''}"] = timing(module, slots)
    for run in kinds.values():  # warm-up: first-use costs
        run()
    samples: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
    for _ in range(args.repeats):
        for kind, run in kinds.items():  # interleaved: each sample sees the same machine
            samples[kind].append(run())
    table = Table(title=f"{args.nodes} node threads, {args.meetings} meetings, median of {args.repeats} "
                        f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    for column in ("", "wall", "CPU s of the process", "per meeting beyond the work"):
        table.add_column(column, justify="right")
    base, _ = medians(samples["one after another"])
    for kind, runs in samples.items():
        wall, cpu = medians(runs)
        table.add_row(kind, f"{wall:.3f} s", f"{cpu:.3f}", f"{(wall - base) / args.meetings * 1e3:.3f} ms")
    print_fitted(table, piped_width=160)


if __name__ == "__main__":
    main()
