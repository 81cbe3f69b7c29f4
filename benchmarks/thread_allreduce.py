"""The threads runtime's all-reduce alone: N node threads reduce a bucket of the gpt model's size.

    python benchmarks/thread_allreduce.py              # 64 nodes, 413,312 floats, 20 rounds
    python benchmarks/thread_allreduce.py --nodes 16

Each node thread all-reduces (mean) its gradient-sized tensor, as two tensors so that it
goes through the bucket as DDP's does, ``--rounds`` times; printed per repeat: wall time
per all-reduce, and the process's CPU time per node and all-reduce.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch

from meshtrain.comm import ThreadCommunicator, ThreadHub


def one_repeat(inputs: list[torch.Tensor], rounds: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of ``rounds`` all-reduces by every node."""
    nodes = len(inputs)
    hub = ThreadHub(nodes)
    ready = threading.Barrier(nodes + 1)

    def node(rank: int) -> None:
        comm = ThreadCommunicator(hub, rank)
        mine = inputs[rank].clone()
        ready.wait()
        for _ in range(rounds):
            comm.all_reduce([mine[:1000], mine[1000:]], op="mean")

    threads = [threading.Thread(target=node, args=(r,)) for r in range(nodes)]
    for t in threads:
        t.start()
    cpu, wall = time.process_time(), time.perf_counter()
    ready.wait()
    for t in threads:
        t.join()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--numel", type=int, default=413_312, help="floats per node (gpt task: 413,312)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each node of the threads runtime
    inputs = [torch.randn(args.numel, generator=torch.Generator().manual_seed(r)) for r in range(args.nodes)]
    print(f"{args.nodes} nodes, {args.numel:,} floats, {args.rounds} all-reduces "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    for _ in range(args.repeats):
        wall, cpu = one_repeat(inputs, args.rounds)
        print(f"wall {wall / args.rounds * 1e3:.2f} ms per all-reduce, "
              f"CPU {cpu / args.rounds / args.nodes * 1e3:.3f} ms per node and all-reduce", flush=True)


if __name__ == "__main__":
    main()
