"""How much does simulating nodes cost? meshtrain's runtimes against a plain PyTorch loop.

Workload (issue 2): 4 nodes, an MLP 784-128-10 on 20k samples, batch 32 per node,
200 steps, for DDP and DiLoCo(H=20). Each meshtrain time is the whole ``fit`` call
(start-up included: threads, or spawning processes and the gloo rendezvous). The
baseline is one plain loop holding the 4 replicas and averaging them by hand: the
physical limit of simulating 4 nodes in one process. The table also gives each further
step's cost against the plain loop's (a fit less a 1-step fit, per step): what a longer run
pays, without the run's start and its end (the run directory and loss.png).

    python benchmarks/runtimes.py            # a line per run, then a table
    python benchmarks/runtimes.py --steps 50 # quicker

``--breakdown`` times DDP in the threads runtime with its all-reduce replaced, to show where
its cost beyond the plain loop goes (see :func:`breakdown`).

``--scale 64`` then simulates 64 nodes of the gpt task's model (0.41M parameters) in the
threads runtime and prints, per node and step, what the runtime costs beyond the nodes'
own compute, and each node's memory for its model and optimizer (see :func:`scale`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import torch
from rich.table import Table
from torch import nn
from torch.utils.data import TensorDataset

from meshtrain import Trainer
from meshtrain.comm import ThreadCommunicator, ThreadHub
from meshtrain.engine.callbacks import node_replica
from meshtrain.strategies import DDP, DiLoCo, Optim, Strategy
from meshtrain.tables import print_fitted
from meshtrain.tasks.gpt import CharGPT, CharWindows

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
    # torch's list kernels, as meshtrain's nodes step on CPU (Optim.build): the same optimizer code.
    if strategy == "ddp":
        opts = [torch.optim.AdamW(r.parameters(), lr=1e-3, foreach=True) for r in replicas]
    else:
        opts = [torch.optim.AdamW(r.parameters(), lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95), foreach=True)
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


def meshtrain_fit(data: TensorDataset, strategy: str, runtime: str, steps: int,
                  concurrent_nodes: int | None = None) -> float:
    torch.manual_seed(0)
    model = MLP()
    strat = DDP() if strategy == "ddp" else DiLoCo(
        H=20, optim=Optim("adamw", weight_decay=0.1, betas=(0.9, 0.95)), lr=4e-4)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        Trainer(model, data).fit(strategy=strat, nodes=NODES, max_steps=steps, batch_size=BATCH,
                                 runtime=runtime, out_dir=out, progress=False,
                                 concurrent_nodes=concurrent_nodes)
    return time.perf_counter() - start


def medians(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """(median wall, median CPU seconds) of (wall, CPU) samples."""
    return statistics.median(w for w, _ in samples), statistics.median(c for _, c in samples)


def _timed(run: Callable[[], float]) -> tuple[float, float]:
    """(wall seconds as ``run`` measures them, CPU seconds of this process meanwhile)."""
    cpu = time.process_time()
    wall = run()
    return wall, time.process_time() - cpu


def _gpt_strategy(name: str) -> Strategy:
    return DDP() if name == "ddp" else DiLoCo(H=20)


def _fit_cpu(model: nn.Module, data: CharWindows, strategy: str, nodes: int, steps: int,
             batch: int, concurrent_nodes: int | None = None) -> tuple[float, float]:
    """(CPU seconds of this process for one threads-runtime fit, the nodes' measured compute
    per node-step from its summary)."""
    with tempfile.TemporaryDirectory() as out:
        cpu = time.process_time()
        result = Trainer(model, data).fit(strategy=_gpt_strategy(strategy), nodes=nodes, max_steps=steps,
                                          batch_size=batch, runtime="threads", out_dir=out, progress=False,
                                          concurrent_nodes=concurrent_nodes)
        return time.process_time() - cpu, result.summary["projected"]["step_seconds"]


def node_state_bytes(model: nn.Module, strategy: str, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Bytes one simulated node holds of its own: its replica's parameters and buffers, their
    gradients, and the strategy's state (optimizer moments; DiLoCo's global copy and outer
    momentum), after one step and a sync. Each storage is counted once; what the nodes share (the
    dataset, frozen weights) is not the node's."""
    replica = node_replica(model)
    strat = _gpt_strategy(strategy)
    strat.setup(replica, ThreadCommunicator(ThreadHub(1), 0), seed=0, max_steps=2, num_samples=1)
    replica(batch).backward()
    grads = [p.grad for p in replica.parameters() if p.grad is not None]
    strat.step(0)
    strat.finish(0)  # DiLoCo's outer momentum exists from its first sync on
    tensors = [*replica.parameters(), *replica.buffers(), *grads]
    tensors += [t for t in _tensors_in(strat.state_dict())]
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _tensors_in(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    return []


def scale(nodes: int, steps: int, batch: int, concurrent_nodes: int | None = None,
          repeats: int = 1) -> None:
    """``nodes`` simulated nodes of the gpt task's model in the threads runtime.

    Overhead per node-step: of each fit, the process's CPU time minus the nodes' own compute
    (forward, backward, optimizer: the summary's ``step_seconds`` times the steady node-steps
    it covers); then that of a fit of ``steps`` steps minus that of one of ``steps // 5`` (so
    start-up, the run directory and the nodes' first steps cancel out), per node-step.
    What remains is the runtime's work: data, guards, callbacks, and simulating the
    collectives (the in-process reduction over all nodes). CPU time, so the figure does not
    depend on how many cores the nodes share; and each fit's compute is taken from that fit,
    so a slower or faster run (a busy machine) cancels out as well. ``repeats`` pairs (the
    strategies interleaved) give a median and range.
    """
    torch.manual_seed(0)
    ids = torch.randint(0, 65, (200_000,), generator=torch.Generator().manual_seed(1))
    data = CharWindows(ids, 64)  # one dataset object, read by every node thread
    model = CharGPT(65, 64, 2, 4, 128, 0.0)
    sample = tuple(torch.stack(t) for t in zip(*(data[i] for i in range(batch)), strict=True))
    parameters = sum(p.numel() for p in model.parameters())
    load_before = os.getloadavg()[0]
    _fit_cpu(model, data, "diloco", 2, 2, batch)  # warm-up: lazy imports (pyplot) and first-use costs
    rss_before = _max_rss_bytes()
    strategies = ("ddp", "diloco")
    samples: dict[str, list[tuple[float, float]]] = {s: [] for s in strategies}  # (compute, overhead)
    rss: dict[str, float] = {}
    for r in range(repeats):
        for strategy in strategies:
            few = max(2, steps // 5)
            short, short_compute = _fit_cpu(model, data, strategy, nodes, few, batch, concurrent_nodes)
            full, compute = _fit_cpu(model, data, strategy, nodes, steps, batch, concurrent_nodes)
            # the compute covers each node's steps but its first (ComputeClock.steady)
            runtime_work = ((full - compute * nodes * (steps - 1))
                            - (short - short_compute * nodes * (few - 1)))
            overhead = runtime_work / (nodes * (steps - few))
            samples[strategy].append((compute, overhead))
            rss.setdefault(strategy, (_max_rss_bytes() - rss_before) / nodes)
            print(f"[{r + 1}/{repeats}] {strategy}: compute {compute * 1e3:.2f} ms, overhead "
                  f"{overhead * 1e3:.3f} ms per node-step", flush=True)
    table = Table(title=f"{nodes} simulated nodes in the threads runtime: gpt model ({parameters:,} "
                        f"parameters), batch {batch} per node, {steps} steps, "
                        f"{concurrent_nodes or 'auto'} computing at once, median of {repeats} "
                        f"(load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} "
                        f"on {os.cpu_count()} cores)")
    for col in ("strategy", "compute per node-step", "overhead per node-step", "overhead / compute",
                "node state (model + optimizer)", "peak RSS growth per node"):
        table.add_column(col, justify="right")
    for strategy in strategies:
        compute = statistics.median(c for c, _ in samples[strategy])
        overheads = sorted(o for _, o in samples[strategy])
        overhead = statistics.median(overheads)
        spread = f" ({overheads[0] * 1e3:.2f} to {overheads[-1] * 1e3:.2f})" if repeats > 1 else ""
        state = node_state_bytes(model, strategy, sample)
        table.add_row(strategy, f"{compute * 1e3:.2f} ms", f"{overhead * 1e3:.3f} ms{spread}",
                      f"{overhead / compute:.1%}", f"{state / 2**20:.2f} MiB",
                      f"{rss[strategy] / 2**20:.2f} MiB")
    print_fitted(table, piped_width=200)
    print("node state: each node's own parameters, gradients and strategy state, counted by storage; "
          "the dataset is one object all nodes read. Peak RSS growth: the process's peak resident "
          "memory over the benchmark, per node (activations and allocator slack included), after "
          "each strategy's first pair of fits.")


def breakdown(data: TensorDataset, steps: int, repeats: int) -> None:
    """Where DDP's cost in the threads runtime goes: the same fit with its all-reduce (i) as
    it is, (ii) replaced by one meeting of the nodes with no data (the hub's own
    :meth:`ThreadHub.exchange`), (iii) replaced by Python's ``threading.Barrier`` (every
    node runnable at once: a barrier cannot give up a run slot), (iv) removed, with every node
    runnable at once and with the default run slots (the nodes then never meet: the floor
    for 4 node threads). Interleaved with the plain loop, medians.

    A diagnostic: the replacements are patched into :class:`ThreadCommunicator` for the
    duration of one fit, and the nodes of (ii)-(iv) do not stay in sync, which is fine for
    timing work of the same size."""
    full = ThreadCommunicator.all_reduce_buckets
    barrier = threading.Barrier(NODES)

    def meet(self: ThreadCommunicator, buckets: object, op: object = "mean", group: object = None,
             *, record: bool = True) -> None:
        self.hub.exchange(self._key(self.members(None)), self.rank, None, lambda _: None)

    def raw_barrier(self: ThreadCommunicator, *args: object, **kwargs: object) -> None:
        barrier.wait()

    def skip(self: ThreadCommunicator, *args: object, **kwargs: object) -> None:
        return None

    variants: dict[str, tuple[Callable[..., None], int | None]] = {
        "DDP as it is": (full, None), "one meeting, no data": (meet, None),
        "threading.Barrier, 4 at once": (raw_barrier, NODES),
        "no all-reduce, 4 at once": (skip, NODES), "no all-reduce": (skip, None)}
    plain: list[float] = []
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(repeats):
        plain.append(plain_loop(data, "ddp", steps))
        for name, (all_reduce, at_once) in variants.items():
            ThreadCommunicator.all_reduce_buckets = all_reduce  # type: ignore[method-assign]
            try:
                samples[name].append(_timed(lambda at_once=at_once: meshtrain_fit(data, "ddp", "threads",
                                                                                  steps, at_once)))
            finally:
                ThreadCommunicator.all_reduce_buckets = full  # type: ignore[method-assign]
            print(f"{name}: {samples[name][-1][0]:.2f} s", flush=True)
    base = statistics.median(plain)
    table = Table(title=f"Where DDP's time goes, threads runtime, {NODES} nodes, MLP, {steps} steps "
                        f"(median of {repeats}; plain loop {base:.2f} s; load average "
                        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    for col in ("the all-reduce", "wall", "/ plain", "CPU s of the process"):
        table.add_column(col, justify="right")
    for name, runs in samples.items():
        wall, cpu = medians(runs)
        table.add_row(name, f"{wall:.2f} s", f"{wall / base:.2f}x", f"{cpu:.2f}")
    print_fitted(table, piped_width=200)


def _max_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="samples of each cell (median)")
    parser.add_argument("--scale", type=int, default=0, metavar="NODES",
                        help="also simulate NODES nodes of the gpt model (threads runtime)")
    parser.add_argument("--scale-only", action="store_true", help="only the --scale table")
    parser.add_argument("--scale-steps", type=int, default=25)
    parser.add_argument("--scale-batch", type=int, default=8)
    parser.add_argument("--scale-repeats", type=int, default=1, help="pairs of fits per strategy (median)")
    parser.add_argument("--concurrent-nodes", default="auto", metavar="LIST",
                        help="threads runtime rows: comma-separated concurrent_nodes values "
                             "(auto: the runtime's default, cores / threads), e.g. 1,auto")
    parser.add_argument("--no-processes", action="store_true", help="skip the processes runtime")
    parser.add_argument("--breakdown", action="store_true",
                        help="only: DDP in the threads runtime with its all-reduce replaced "
                             "(where its time goes)")
    args = parser.parse_args()
    at_once = [None if v == "auto" else int(v) for v in args.concurrent_nodes.split(",")]
    if args.breakdown:
        data = make_data()
        meshtrain_fit(data, "ddp", "threads", 5)  # warm-up
        breakdown(data, args.steps, args.repeats)
        return
    if args.scale_only:
        for concurrent in at_once:
            scale(args.scale or 64, args.scale_steps, args.scale_batch, concurrent, args.scale_repeats)
        return
    data = make_data()
    kinds: dict[str, Callable[[str, int], float]] = {
        "plain": lambda strategy, steps: plain_loop(data, strategy, steps)}
    for value in args.concurrent_nodes.split(","):
        at_once = None if value == "auto" else int(value)
        name = "threads" if at_once is None else f"threads, {at_once} at once"
        kinds[name] = lambda strategy, steps, c=at_once: meshtrain_fit(data, strategy, "threads", steps, c)
    if not args.no_processes:
        kinds["processes"] = lambda strategy, steps: meshtrain_fit(data, strategy, "processes", steps)
    # Warm-up, not timed: first-use costs (lazy imports such as pyplot, the fork server's
    # start) would otherwise land in whichever sample comes first.
    print("warm-up", flush=True)
    plain_loop(data, "ddp", 5)
    for runtime in ("threads",) if args.no_processes else ("threads", "processes"):
        meshtrain_fit(data, "ddp", runtime, 5)
    load_before = os.getloadavg()[0]
    wall: dict[tuple[str, str], float] = {}
    cpu: dict[tuple[str, str], float] = {}
    per_step: dict[tuple[str, str], float] = {}  # (steps-step fit - 1-step fit) / (steps - 1)
    done, total = 0, 2 * args.repeats * len(kinds)
    for strategy in ("ddp", "diloco"):
        samples: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
        one_step: dict[str, list[float]] = {kind: [] for kind in kinds}
        # Interleaved (plain, threads, processes, plain, ...): on a loaded machine the ratios
        # then compare runs that saw the same load.
        for _ in range(args.repeats):
            for kind, run in kinds.items():
                samples[kind].append(_timed(lambda run=run, strategy=strategy: run(strategy, args.steps)))
                # A 1-step fit: the run's start and end (threads or processes, the gloo group,
                # the run directory and loss.png), which the plain loop does not have.
                one_step[kind].append(run(strategy, 1))
                done += 1
                print(f"[{done}/{total}] {strategy} {kind}: {samples[kind][-1][0]:.2f} s "
                      f"(CPU of this process {samples[kind][-1][1]:.2f} s; "
                      f"1 step {one_step[kind][-1]:.2f} s)", flush=True)
        for kind in kinds:
            wall[strategy, kind], cpu[strategy, kind] = medians(samples[kind])
            start_and_end = statistics.median(one_step[kind])
            per_step[strategy, kind] = (wall[strategy, kind] - start_and_end) / (args.steps - 1)
    table = Table(title=f"{NODES} nodes, MLP 784-128-10, batch {BATCH}, {args.steps} steps (median of "
                        f"{args.repeats} interleaved; 1 torch thread per replica or node; load average "
                        f"{load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    table.add_column("strategy")
    others = [kind for kind in kinds if kind != "plain"]
    table.add_column("plain loop, 4 replicas", justify="right")
    for kind in others:
        table.add_column(kind, justify="right")
        table.add_column(f"{kind} / plain", justify="right")
    for kind in others:
        table.add_column(f"per step: {kind} / plain", justify="right")
    table.add_column("CPU s: plain", justify="right")
    for kind in others:
        if kind.startswith("threads"):  # node processes' CPU is not this process's
            table.add_column(f"CPU: {kind} / plain", justify="right")
    for strategy in ("ddp", "diloco"):
        plain = wall[strategy, "plain"]
        row = [strategy, f"{plain:.2f} s"]
        for kind in others:
            row += [f"{wall[strategy, kind]:.2f} s", f"{wall[strategy, kind] / plain:.2f}x"]
        for kind in others:
            row.append(f"{per_step[strategy, kind] / per_step[strategy, 'plain']:.2f}x "
                       f"({per_step[strategy, kind] * 1e3:.2f} ms)")
        row.append(f"{cpu[strategy, 'plain']:.2f}")
        for kind in others:
            if kind.startswith("threads"):
                row.append(f"{cpu[strategy, kind] / cpu[strategy, 'plain']:.2f}x "
                           f"({cpu[strategy, kind]:.2f} s)")
        table.add_row(*row)
    print_fitted(table, piped_width=240)
    # On a loaded machine the scheduler gives 4 node threads more of the cores than one
    # plain thread, so wall ratios flatter the threads runtime; CPU seconds do not.
    print("CPU s: CPU time of this process (every thread); node processes are not counted.")
    print(f"per step: a {args.steps}-step fit less a 1-step fit, over {args.steps - 1} steps (medians), "
          "against the plain loop's the same way, with the ms per step: the cost of each further step, "
          "without the run's start and end (threads or processes started, the gloo group, the run "
          "directory and loss.png).")
    if args.scale:
        for concurrent in at_once:
            scale(args.scale, args.scale_steps, args.scale_batch, concurrent, args.scale_repeats)


if __name__ == "__main__":
    main()
