"""How much does simulating nodes cost? meshtrain's runtimes against a plain PyTorch loop.

Workload (issue 2): 4 nodes, an MLP 784-128-10 on 20k samples, batch 32 per node,
200 steps, for DDP and DiLoCo(H=20). Each meshtrain time is the whole ``fit`` call
(start-up included: threads, or spawning processes and the gloo rendezvous). The
baseline is one plain loop holding the 4 replicas and averaging them by hand: the
physical limit of simulating 4 nodes in one process.

    python benchmarks/runtimes.py            # a line per run, then a table
    python benchmarks/runtimes.py --steps 50 # quicker
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils.data import TensorDataset

from meshtrain import Trainer
from meshtrain.strategies import DDP, DiLoCo, Optim

NODES, BATCH, SAMPLES = 4, 32, 20_000


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 784, generator=g)
    y = torch.randint(0, 10, (SAMPLES,), generator=g)
    return TensorDataset(x, y)


def plain_loop(data: TensorDataset, strategy: str, steps: int, H: int = 20) -> float:
    """4 replicas in one plain loop: DDP (average grads) or DiLoCo (average every H).

    One torch thread, as each meshtrain node has by default: on a loaded machine several
    intra-op threads spin-wait for each other and the loop slows down tenfold."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _plain_loop(data, strategy, steps, H)
    finally:
        torch.set_num_threads(threads_before)


def _plain_loop(data: TensorDataset, strategy: str, steps: int, H: int) -> float:
    start = time.perf_counter()
    torch.manual_seed(0)
    base = MLP()
    replicas = [MLP() for _ in range(NODES)]
    for r in replicas:
        r.load_state_dict(base.state_dict())
    x, y = data.tensors
    shards = [torch.arange(i, SAMPLES, NODES) for i in range(NODES)]
    if strategy == "ddp":
        opts = [torch.optim.AdamW(r.parameters(), lr=1e-3) for r in replicas]
    else:
        opts = [torch.optim.AdamW(r.parameters(), lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95))
                for r in replicas]
        outer = [p.detach().clone() for p in base.parameters()]
        outer_opt = torch.optim.SGD(outer, lr=0.7, momentum=0.9, nesterov=True)
    for step in range(steps):
        for i, (r, opt) in enumerate(zip(replicas, opts, strict=True)):
            idx = shards[i][step * BATCH % len(shards[i]):][:BATCH]
            r((x[idx], y[idx])).backward()
            if strategy != "ddp":
                opt.step()
                opt.zero_grad()
        if strategy == "ddp":
            grads = [torch.cat([p.grad.reshape(-1) for p in r.parameters()]) for r in replicas]
            mean = torch.stack(grads).mean(0)
            for r, opt in zip(replicas, opts, strict=True):
                torch.nn.utils.vector_to_parameters(mean, [p.grad for p in r.parameters()])
                opt.step()
                opt.zero_grad()
        elif (step + 1) % H == 0:
            with torch.no_grad():
                flats = [torch.nn.utils.parameters_to_vector(r.parameters()) for r in replicas]
                delta = torch.nn.utils.parameters_to_vector(outer) - torch.stack(flats).mean(0)
                offset = 0
                for o in outer:
                    o.grad = delta[offset : offset + o.numel()].view_as(o).clone()
                    offset += o.numel()
                outer_opt.step()
                for r in replicas:
                    torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(outer),
                                                        r.parameters())
    return time.perf_counter() - start


def meshtrain_fit(data: TensorDataset, strategy: str, runtime: str, steps: int) -> float:
    torch.manual_seed(0)
    model = MLP()
    strat = DDP() if strategy == "ddp" else DiLoCo(
        H=20, optim=Optim("adamw", weight_decay=0.1, betas=(0.9, 0.95)), lr=4e-4)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        Trainer(model, data).fit(strategy=strat, nodes=NODES, max_steps=steps, batch_size=BATCH,
                                 runtime=runtime, out_dir=out, progress=False)
    return time.perf_counter() - start


def _timed(run: Callable[[], float]) -> tuple[float, float]:
    """(wall seconds as ``run`` measures them, CPU seconds of this process meanwhile)."""
    cpu = time.process_time()
    wall = run()
    return wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="samples of each cell (median)")
    args = parser.parse_args()
    data = make_data()
    kinds: dict[str, Callable[[str], float]] = {
        "plain": lambda strategy: plain_loop(data, strategy, args.steps),
        "threads": lambda strategy: meshtrain_fit(data, strategy, "threads", args.steps),
        "processes": lambda strategy: meshtrain_fit(data, strategy, "processes", args.steps),
    }
    load_before = os.getloadavg()[0]
    wall: dict[tuple[str, str], float] = {}
    cpu: dict[tuple[str, str], float] = {}
    done, total = 0, 2 * args.repeats * len(kinds)
    for strategy in ("ddp", "diloco"):
        samples: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
        # Interleaved (plain, threads, processes, plain, ...): on a loaded machine the ratios
        # then compare runs that saw the same load.
        for _ in range(args.repeats):
            for kind, run in kinds.items():
                samples[kind].append(_timed(lambda run=run, strategy=strategy: run(strategy)))
                done += 1
                print(f"[{done}/{total}] {strategy} {kind}: {samples[kind][-1][0]:.2f} s "
                      f"(CPU of this process {samples[kind][-1][1]:.2f} s)", flush=True)
        for kind in kinds:
            wall[strategy, kind] = statistics.median(w for w, _ in samples[kind])
            cpu[strategy, kind] = statistics.median(c for _, c in samples[kind])
    table = Table(title=f"{NODES} nodes, MLP 784-128-10, batch {BATCH}, {args.steps} steps (median of "
                        f"{args.repeats} interleaved; 1 torch thread per replica or node; load average "
                        f"{load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    table.add_column("strategy")
    for col in ("plain loop, 4 replicas", "threads", "processes", "threads / plain", "processes / plain",
                "CPU s: plain", "CPU s: threads", "threads / plain (CPU)"):
        table.add_column(col, justify="right")
    for strategy in ("ddp", "diloco"):
        plain, threads, procs = (wall[strategy, kind] for kind in kinds)
        cpu_plain, cpu_threads = cpu[strategy, "plain"], cpu[strategy, "threads"]
        table.add_row(strategy, f"{plain:.2f} s", f"{threads:.2f} s", f"{procs:.2f} s",
                      f"{threads / plain:.2f}x", f"{procs / plain:.2f}x", f"{cpu_plain:.2f}",
                      f"{cpu_threads:.2f}", f"{cpu_threads / cpu_plain:.2f}x")
    Console(width=200).print(table)
    # On a loaded machine the scheduler gives 4 node threads more of the cores than one
    # plain thread, so wall ratios flatter the threads runtime; CPU seconds do not.
    print("CPU s: CPU time of this process (every thread); node processes are not counted.")


if __name__ == "__main__":
    main()
