"""Does a rank's step slow down when the other core trains too, with no launcher at all?

A 2-host run of ``benchmarks/scaling.py`` keeps both cores busy with ranks, a 1-host run
one. This runs the ranks' compute alone: the gpt task's model (413,312 parameters, batch
32, 64-character windows, Adam, one torch thread), ``--steps`` training steps in a
process pinned to core 0, either alone ("alone") or beside an identical process pinned to
core 1 ("pair"), alternating, ``--repeats`` times each. It prints the medians of the core-0
process's wall and CPU (thread) seconds for the steps after the first 5. No SSH, no
launcher, no communication: a difference is the two cores sharing the machine (and, on a
loaded machine, how the other processes then preempt the pair).

It also prints how much the same step's CPU time varies from step to step in the pairs (the
work is identical every step: same batch, same shapes), and what that alone costs a
synchronous strategy on two hosts: DDP's step ends when the slower of the two has computed,
so its wait is ``mean(max(a_i, b_i)) - mean(a_i, b_i)`` over the steps i the two processes
took side by side (DiLoCo with H=20: the same over rounds of 20 steps). That is the
"waiting" a 2-host ``benchmarks/scaling.py`` run measures, here with no communication at
all; with the pair's slowdown it bounds the 2-host speedup this machine can show.

    python benchmarks/core_interference.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

WARM = 5


def preempted() -> int:
    """How often this thread was taken off its core while it could run (Linux; 0 elsewhere)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("nonvoluntary_ctxt_switches"))
    except (OSError, StopIteration):
        return 0


def train(steps: int) -> None:
    """Child: print '<wall seconds> <thread CPU seconds> <preemptions>' of the steps after WARM,
    then a JSON list of each of those steps' thread CPU seconds."""
    import torch

    from meshtrain.tasks.gpt import CharGPT

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = CharGPT(65)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = (torch.randint(0, 65, (32, 64)), torch.randint(0, 65, (32, 64)))
    per_step = []
    for step in range(steps):
        if step == WARM:
            wall, cpu, switches = time.perf_counter(), time.thread_time(), preempted()
        started = time.thread_time()
        optimizer.zero_grad()
        model(batch).backward()
        optimizer.step()
        if step >= WARM:
            per_step.append(time.thread_time() - started)
    print(f"{time.perf_counter() - wall} {time.thread_time() - cpu} {preempted() - switches}", flush=True)
    print(json.dumps(per_step), flush=True)


def run(cores: list[int], steps: int) -> tuple[tuple[float, float, int], list[list[float]]]:
    """Start one child per core at once: the core-0 child's wall and CPU seconds and
    preemptions, and every child's CPU seconds per step."""
    children = [subprocess.Popen(["taskset", "-c", str(c), sys.executable, __file__, "--child",
                                  "--steps", str(steps)], stdout=subprocess.PIPE, text=True)
                for c in cores]
    outputs = [p.communicate()[0].splitlines() for p in children]
    if any(p.returncode for p in children):
        sys.exit("a child failed")
    wall, cpu, switches = outputs[0][0].split()
    return (float(wall), float(cpu), int(switches)), [json.loads(out[1]) for out in outputs]


def lag1_correlation(values: list[float]) -> float:
    """How much a step's time predicts the next one's (0: not at all, 1: fully)."""
    mean = statistics.fmean(values)
    spread = sum((v - mean) ** 2 for v in values)
    if spread == 0:
        return 0.0
    return sum((a - mean) * (b - mean) for a, b in zip(values[:-1], values[1:], strict=True)) / spread


def sync_wait(a: list[float], b: list[float], every: int) -> tuple[float, float]:
    """(mean step, wait per step) of two processes' side-by-side step times synchronised
    every ``every`` steps: each round ends when the slower of the two has computed it."""
    n = min(len(a), len(b)) // every * every
    rounds = [(sum(a[i:i + every]), sum(b[i:i + every])) for i in range(0, n, every)]
    mean = statistics.fmean(a[:n] + b[:n])
    return mean, statistics.fmean(max(x, y) for x, y in rounds) / every - mean


def print_spread(pairs: list[list[list[float]]], alone_wall: float, pair_wall: float) -> None:
    """Per-step CPU time of the pairs' processes, the wait of a synchronous step on two hosts
    it implies (each pair's steps side by side, by index: they ran at the same time), and
    the 2-host speedup this machine allows with no communication at all."""
    every = [t for pair in pairs for steps in pair for t in steps]
    median = statistics.median(every)
    lag1 = statistics.median(lag1_correlation(steps) for pair in pairs for steps in pair)
    low, *_, high = statistics.quantiles(every, n=20)
    print(f"\nthe same step's CPU time, every process of the pairs ({len(every)} steps): median "
          f"{median * 1e3:.1f} ms, standard deviation {statistics.pstdev(every) * 1e3:.1f} ms "
          f"({statistics.pstdev(every) / median:.0%}), 5th-95th percentile "
          f"{low * 1e3:.1f}-{high * 1e3:.1f} ms, "
          f"lag-1 autocorrelation {lag1:.2f} (median of the processes)")
    for every_steps, who in ((1, "every step (DDP)"), (20, "every 20 steps (DiLoCo, H=20)")):
        measured = [sync_wait(a, b, every_steps) for a, b in pairs]
        wait = statistics.median(w for _, w in measured)
        # One host: the core-0 process alone. Two: beside its twin, plus the wait for the slower.
        ceiling = 2 * alone_wall / (pair_wall * (1 + wait / statistics.median(m for m, _ in measured)))
        print(f"synchronised {who}: waits {wait * 1e3:.1f} ms a step for the slower process "
              f"({wait * 100:.2f} s per 100 steps); with the pair's slower steps, a 2-host speedup "
              f"of at most {ceiling:.2f}x with no communication at all")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        train(args.steps)
        return
    results: dict[str, list[tuple[float, float, int]]] = {"alone": [], "pair": []}
    pairs: list[list[list[float]]] = []
    loads = []
    for r in range(args.repeats):
        for name, cores in (("alone", [0]), ("pair", [0, 1])):
            loads.append(os.getloadavg()[0])
            core0, per_step = run(cores, args.steps)
            results[name].append(core0)
            if name == "pair":
                pairs.append(per_step)
            wall, cpu, switches = core0
            print(f"run {r + 1} {name}: wall {wall:.2f} s, CPU {cpu:.2f} s, preempted {switches} times "
                  f"(load {loads[-1]:.1f})", flush=True)
    print(f"\n{args.steps - WARM} steps of the gpt model, core-0 process, medians of {args.repeats}; "
          f"load average {min(loads):.1f}-{max(loads):.1f}")
    print(f"{'':8}{'wall s':>10}{'CPU s':>10}{'preempted':>11}")
    for name, values in results.items():
        wall, cpu, switches = (statistics.median(v[i] for v in values) for i in range(3))
        print(f"{name:8}{wall:10.2f}{cpu:10.2f}{switches:11.0f}")
    alone = statistics.median(v[1] for v in results["alone"])
    pair = statistics.median(v[1] for v in results["pair"])
    print(f"pair / alone CPU: {pair / alone:.3f}x")
    print_spread(pairs, statistics.median(v[0] for v in results["alone"]),
                 statistics.median(v[0] for v in results["pair"]))


if __name__ == "__main__":
    main()
