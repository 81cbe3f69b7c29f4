"""The vmap runtime against the threads runtime: 16 simulated nodes of two models on CPU.

Workloads (issue 19, item 5): the digits task's MLP (64-128-10, batch 32 per node) and the
gpt task's model (vocabulary 65, 2 layers, dim 128: 413,312 parameters; batch 32 windows
of 64 characters per node), each with DDP and DiLoCo (H=20). Each time is a whole ``fit``
call (start-up and the run directory included), with 1 torch thread per node in the threads
runtime and 1 torch thread in all for the vmap runtime unless ``--vmap-threads`` says more.
Runs are interleaved (threads, vmap, threads, ...) so that both see the same load; the
table shows medians, and the final losses of the two runtimes side by side.

"nodes' compute" is the threads run's own measure of its nodes' forward, backward and
optimizer work (the summary's compute per step, each node thread's CPU time, times nodes
and steps). A runtime that removed every other cost but computed the same kernels could be
at most "threads CPU / nodes' compute" faster (the "overhead bound" column); beating it
takes cheaper kernels (larger batched ones), not less overhead.

    python benchmarks/vmap.py                       # 16 nodes, a line per run, then a table
    python benchmarks/vmap.py --nodes 8 --steps 20  # quicker
    python benchmarks/vmap.py --device cuda --steps 20 --repeats 2   # both runtimes on a GPU

On ``--device cuda`` each time ends after ``torch.cuda.synchronize()``; the CPU columns then
say what the host spent driving the GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.table import Table
from torch import nn
from torch.utils.data import Dataset

from meshtrain import Trainer
from meshtrain.strategies import DDP, DiLoCo, Strategy
from meshtrain.tables import print_fitted
from meshtrain.tasks.digits import DigitsMLP, load_digits_split
from meshtrain.tasks.gpt import CharGPT, CharWindows


def digits() -> tuple[nn.Module, Dataset]:
    torch.manual_seed(0)
    return DigitsMLP(128), load_digits_split()[0]


def gpt() -> tuple[nn.Module, Dataset]:
    torch.manual_seed(0)
    ids = torch.randint(0, 65, (80_000,), generator=torch.Generator().manual_seed(1))
    return CharGPT(65, 64, 2, 4, 128, 0.0), CharWindows(ids, 64)


WORKLOADS: dict[str, Callable[[], tuple[nn.Module, Dataset]]] = {"digits MLP": digits, "gpt": gpt}
STRATEGIES: dict[str, Callable[[], Strategy]] = {"ddp": DDP, "diloco": lambda: DiLoCo(H=20)}


def timed_fit(workload: str, strategy: str, runtime: str, nodes: int, steps: int,
              threads: int, device: str = "cpu") -> tuple[float, float, float, float]:
    """(wall seconds, CPU seconds of this process, final train loss, the nodes' measured
    compute in seconds: compute per node-step times nodes and steps) of one ``fit``."""
    model, data = WORKLOADS[workload]()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    cpu, start = time.process_time(), time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        result = Trainer(model, data).fit(STRATEGIES[strategy](), nodes=nodes, max_steps=steps,
                                          batch_size=32, runtime=runtime, threads=threads,
                                          device=device, out_dir=out, progress=False)
        if cuda:
            torch.cuda.synchronize()
    compute = result.summary["projected"]["step_seconds"] * nodes * steps
    return time.perf_counter() - start, time.process_time() - cpu, result.summary["final_train_loss"], compute


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3, help="samples of each cell (median)")
    parser.add_argument("--vmap-threads", type=int, default=1, help="torch threads of the vmap run")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where both runtimes compute")
    args = parser.parse_args()
    # Warm-up, not timed: first-use costs (a CUDA context, kernels loaded, lazy imports)
    # would otherwise land in whichever sample comes first.
    for workload in args.workloads:
        for runtime, threads in (("threads", 1), ("vmap", args.vmap_threads)):
            timed_fit(workload, args.strategies[0], runtime, args.nodes, 2, threads, args.device)
    load_before = os.getloadavg()[0]
    rows: list[list[Any]] = []
    for workload in args.workloads:
        for strategy in args.strategies:
            samples: dict[str, list[tuple[float, float, float, float]]] = {"threads": [], "vmap": []}
            for _ in range(args.repeats):
                for runtime, threads in (("threads", 1), ("vmap", args.vmap_threads)):
                    samples[runtime].append(timed_fit(workload, strategy, runtime, args.nodes,
                                                      args.steps, threads, args.device))
                    wall, cpu, loss, _ = samples[runtime][-1]
                    print(f"{workload} {strategy} {runtime}: {wall:.2f} s (CPU {cpu:.2f} s), "
                          f"final loss {loss:.6f}", flush=True)
            wall = {k: statistics.median(s[0] for s in v) for k, v in samples.items()}
            cpu = {k: statistics.median(s[1] for s in v) for k, v in samples.items()}
            compute = statistics.median(s[3] for s in samples["threads"])
            rows.append([workload, strategy, f"{wall['threads']:.2f} s", f"{wall['vmap']:.2f} s",
                         f"{wall['threads'] / wall['vmap']:.1f}x", f"{cpu['threads']:.2f}",
                         f"{cpu['vmap']:.2f}", f"{cpu['threads'] / cpu['vmap']:.1f}x",
                         f"{compute:.2f}", f"{cpu['threads'] / compute:.1f}x",
                         f"{samples['threads'][-1][2]:.6f}", f"{samples['vmap'][-1][2]:.6f}"])
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    table = Table(title=f"{where}: {args.nodes} nodes, batch 32 per node, {args.steps} steps, median of "
                        f"{args.repeats} interleaved runs; vmap on {args.vmap_threads} torch thread(s); "
                        f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} on "
                        f"{os.cpu_count()} cores")
    for col in ("workload", "strategy", "threads", "vmap", "speed-up", "CPU s: threads", "CPU s: vmap",
                "speed-up (CPU)", "nodes' compute (threads, CPU s)", "overhead bound",
                "final loss: threads", "final loss: vmap"):
        table.add_column(col, justify="left" if col in ("workload", "strategy") else "right")
    for row in rows:
        table.add_row(*row)
    print_fitted(table, piped_width=220)


if __name__ == "__main__":
    main()
