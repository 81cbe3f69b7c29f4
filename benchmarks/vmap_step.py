"""One forward and backward of 16 gpt-task nodes on CPU: node by node, as one vmap call, in chunks.

What the vmap runtime's step costs against the same nodes computed one after another (what
the threads runtime's nodes compute, without its threads): the gpt task's model (413,312
parameters), batch 32 windows of 64 characters per node, 1 torch thread, CPU seconds and
minor page faults of this process (``getrusage``). The variants alternate, ``--repeats``
rounds; the table shows the median CPU time and the median faults.

    python benchmarks/vmap_step.py                 # 16 nodes, chunks of 16, 4 and 1
    python benchmarks/vmap_step.py --batch 8       # smaller activations
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from collections.abc import Callable

import torch
from rich.table import Table

from meshtrain.engine.runtimes.vmap import _loss_function, _nodes_per_chunk
from meshtrain.tables import print_fitted
from meshtrain.tasks.gpt import CharGPT, CharWindows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 4, 1])
    args = parser.parse_args()
    torch.set_num_threads(1)
    nodes = args.nodes
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, 65, (nodes, args.batch, 64), generator=generator)
    y = torch.randint(0, 65, (nodes, args.batch, 64), generator=generator)
    torch.manual_seed(0)
    model = CharGPT(65, 64, 2, 4, 128, 0.0)
    stacked = {n: p.detach().unsqueeze(0).expand(nodes, *p.shape).clone()
               for n, p in model.named_parameters()}
    losses = _loss_function(model, 0, "error")

    def node_by_node() -> None:
        for i in range(nodes):
            model.zero_grad()
            model((x[i], y[i])).backward()

    def vmapped(chunk: int) -> Callable[[], None]:
        def run() -> None:
            for start in range(0, nodes, chunk):
                part = {n: t[start:start + chunk].requires_grad_(True) for n, t in stacked.items()}
                losses(part, (x[start:start + chunk], y[start:start + chunk])).sum().backward()
        return run

    variants = {"node by node": node_by_node, **{f"vmap, chunks of {k}": vmapped(k) for k in args.chunks}}
    for run in variants.values():
        run()  # warm-up: first-call allocations and dispatch caches
    load_before = os.getloadavg()[0]
    samples: dict[str, list[tuple[float, int]]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, run in variants.items():
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            cpu = time.process_time()
            run()
            samples[name].append((time.process_time() - cpu,
                                  resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
    chosen = _nodes_per_chunk(model, [(CharWindows(x[0].flatten(), 64), None)] * nodes, None,
                              torch.device("cpu"), args.batch)
    base = statistics.median(s[0] for s in samples["node by node"])
    table = Table(title=f"{nodes} gpt nodes, batch {args.batch}, one forward and backward, 1 thread, "
                        f"median of {args.repeats}; the runtime picks chunks of {chosen}; load average "
                        f"{load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for col in ("variant", "CPU s", "vs node by node", "page faults"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for name, values in samples.items():
        cpu = statistics.median(v[0] for v in values)
        faults = statistics.median(v[1] for v in values)
        table.add_row(name, f"{cpu:.3f}", f"{cpu / base:.2f}x", f"{faults:,.0f}")
    print_fitted(table, piped_width=200)


if __name__ == "__main__":
    main()
