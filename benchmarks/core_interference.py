"""Does a rank's step slow down when the other core trains too, with no launcher at all?

A 2-host run of ``benchmarks/scaling.py`` keeps both cores busy with ranks, a 1-host run
one. This runs the ranks' compute alone: the gpt task's model (413,312 parameters, batch
32, 64-character windows, Adam, one torch thread), ``--steps`` training steps in a
process pinned to core 0, either alone ("alone") or beside an identical process pinned to
core 1 ("pair"), alternating, ``--repeats`` times each. It prints the medians of the core-0
process's wall and CPU (thread) seconds for the steps after the first 5. No SSH, no
launcher, no communication: a difference is the two cores sharing the machine (and, on a
loaded machine, how the other processes then preempt the pair).

    python benchmarks/core_interference.py --repeats 5
"""

from __future__ import annotations

import argparse
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
    """Child: print '<wall seconds> <thread CPU seconds> <preemptions>' of the steps after WARM."""
    import torch

    from meshtrain.tasks.gpt import CharGPT

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = CharGPT(65)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = (torch.randint(0, 65, (32, 64)), torch.randint(0, 65, (32, 64)))
    for step in range(steps):
        if step == WARM:
            wall, cpu, switches = time.perf_counter(), time.thread_time(), preempted()
        optimizer.zero_grad()
        model(batch).backward()
        optimizer.step()
    print(f"{time.perf_counter() - wall} {time.thread_time() - cpu} {preempted() - switches}", flush=True)


def run(cores: list[int], steps: int) -> tuple[float, float, int]:
    """Start one child per core at once; the core-0 child's wall and CPU seconds and
    preemptions."""
    children = [subprocess.Popen(["taskset", "-c", str(c), sys.executable, __file__, "--child",
                                  "--steps", str(steps)], stdout=subprocess.PIPE, text=True)
                for c in cores]
    outputs = [p.communicate()[0] for p in children]
    if any(p.returncode for p in children):
        sys.exit("a child failed")
    wall, cpu, switches = outputs[0].split()
    return float(wall), float(cpu), int(switches)


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
    loads = []
    for r in range(args.repeats):
        for name, cores in (("alone", [0]), ("pair", [0, 1])):
            loads.append(os.getloadavg()[0])
            results[name].append(run(cores, args.steps))
            wall, cpu, switches = results[name][-1]
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


if __name__ == "__main__":
    main()
