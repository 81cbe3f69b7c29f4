"""What one launched DDP step sends: collectives, messages and bytes, counted on rank 0.

Two ranks under torchrun on loopback (the launched runtime, as on real hosts), each
pinned to a core with one torch thread, train the gpt task's model (vocabulary 65: 413,312
parameters, 28 tensors) with DDP at batch 32, progress lines on. Every point-to-point
send is counted, so the table shows what crosses the wire beside what meshtrain records.

    python benchmarks/ddp_step.py             # 100 steps
    python benchmarks/ddp_step.py --steps 40
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def _rank(steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    counts: collections.Counter[str] = collections.Counter()
    real_isend = dist.isend

    def counting_isend(tensor: torch.Tensor, dst: int, *args: Any, **kwargs: Any) -> Any:
        counts["messages"] += 1
        counts["bytes"] += tensor.numel() * tensor.element_size()
        return real_isend(tensor, dst, *args, **kwargs)

    dist.isend = counting_isend  # the ring sends through torch.distributed.isend only

    from meshtrain import Trainer
    from meshtrain.comm import torch_dist
    from meshtrain.strategies import DDP
    from meshtrain.tasks.gpt import CharGPT, CharWindows

    real_ring = torch_dist.TorchDistCommunicator._ring_all_reduce

    def counting_ring(self: Any, flat: torch.Tensor, op: Any, members: list[int]) -> torch.Tensor:
        if self.step >= 0:  # not start-up
            counts["all_reduces"] += 1
        return real_ring(self, flat, op, members)

    torch_dist.TorchDistCommunicator._ring_all_reduce = counting_ring  # type: ignore[method-assign]
    torch.manual_seed(0)
    ids = torch.randint(0, 65, (40_000,), generator=torch.Generator().manual_seed(1))
    result = Trainer(CharGPT(65, 64, 2, 4, 128, 0.0), CharWindows(ids, 64)).fit(
        strategy=DDP(), max_steps=steps, batch_size=32, out_dir=out, threads=1, progress=True)
    if rank == 0:
        seconds = [row["seconds"] for row in result.history]
        warm = min(5, steps - 1)
        print("COUNTS " + json.dumps({
            **counts, "steps": steps, "recorded": result.summary["bytes_sent_per_node"],
            "ms_per_step": (seconds[-1] - seconds[warm]) / max(1, steps - 1 - warm) * 1e3}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    if "RANK" in os.environ:
        _rank(args.steps, os.environ["DDP_STEP_OUT"])
        return
    torchrun = Path(sys.executable).parent / "torchrun"
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "DDP_STEP_OUT": out}
        done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", __file__,
                               "--steps", str(args.steps)], env=env, capture_output=True, text=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith("COUNTS ")), None)
    if done.returncode != 0 or line is None:
        sys.exit(f"the run failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    c = json.loads(line.removeprefix("COUNTS "))
    n = c["steps"]
    print(f"DDP, 2 launched ranks on loopback, gpt model, batch 32, {n} steps (rank 0; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print(f"  all-reduces during the steps   {c['all_reduces']:>12}  ({c['all_reduces'] / n:.2f} per step)")
    print(f"  messages sent (whole run)      {c['messages']:>12}  ({c['messages'] / n:.2f} per step)")
    print(f"  bytes sent on the wire         {c['bytes']:>12}  (start-up and reports included)")
    print(f"  bytes sent, recorded (steps)   {int(c['recorded']):>12}  ({c['recorded'] / n:,.0f} per step)")
    print(f"  ms per step (after step 5)     {c['ms_per_step']:>12.1f}")


if __name__ == "__main__":
    main()
