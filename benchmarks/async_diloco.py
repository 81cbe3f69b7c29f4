"""Time to a target validation loss with one node 3x slower: asynchronous DiLoCo against
synchronous DiLoCo, with and without ``--balance``.

Each run is ``meshtrain simulate`` on digits (the MLP), 2 nodes, ``--straggler
node=1,slowdown=3``, validation every few steps; the time is the projected wall clock of
metrics.csv (``projected_seconds``: each step's compute at ``--step-seconds`` times the
slowest node's factor, plus its communication on the cluster), read at the first
validation at or below the target. A fixed ``--step-seconds`` makes the clock the same on
any machine. DiLoCo waits 3 steps' time for the straggler at every step; ``--balance``
gives the slow node a quarter of the global batch; async-diloco runs the slow node's
inner steps at its own pace (8 of the fast node's 25 per round, DyLU) and applies the two
updates with delayed Nesterov. Medians over the seeds; every run reaches its own final loss
too.

    python benchmarks/async_diloco.py                      # seeds 0-2, 300 steps, target 0.45
    python benchmarks/async_diloco.py --seeds 0 1 2 3 4 --target 0.4
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.table import Table

from meshtrain.tables import print_fitted

RUNS = {
    "diloco": ["--strategy", "diloco"],
    "diloco --balance": ["--strategy", "diloco", "--balance"],
    "async-diloco": ["--strategy", "async-diloco"],
}


def _simulate(out: Path, name: str, seed: int,
              args: argparse.Namespace) -> tuple[tuple[float, int] | None, float, float]:
    """((projected seconds, step) at the target or None, final val loss, projected total seconds)."""
    run_id = f"{name.replace(' ', '').replace('-', '')}-{seed}"
    command = [sys.executable, "-m", "meshtrain", "simulate", *RUNS[name], "--nodes", "2",
               "--steps", str(args.steps), "--seed", str(seed), "--val-interval", str(args.val_interval),
               "--straggler", "node=1,slowdown=3", "--step-seconds", str(args.step_seconds),
               "--cluster", args.cluster, "--out", str(out), "--run-id", run_id, "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"$ {' '.join(command)}\n{(done.stdout + done.stderr)[-3000:]}")
    with (out / run_id / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    reached = next(((float(r["projected_seconds"]), int(r["step"])) for r in rows
                    if r["val_loss"] and float(r["val_loss"]) <= args.target), None)
    summary = json.loads((out / run_id / "summary.json").read_text())
    return reached, float(summary["final_val_loss"]), float(summary["projected"]["total_seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--target", type=float, default=0.45)
    parser.add_argument("--val-interval", type=int, default=5)
    parser.add_argument("--step-seconds", type=float, default=0.01)
    parser.add_argument("--cluster", default="gbe")
    args = parser.parse_args()
    table = Table(title=f"digits, 2 nodes, node 1 3x slower: projected seconds to val loss <= {args.target} "
                        f"({args.steps} steps, step {args.step_seconds} s, {args.cluster}; median of seeds "
                        f"{', '.join(map(str, args.seeds))})")
    for column in ("strategy", "to target (s)", "at step", "reached", "final val loss", "whole run (s)"):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    with tempfile.TemporaryDirectory() as tmp:
        for name in RUNS:
            results = [_simulate(Path(tmp), name, seed, args) for seed in args.seeds]
            reached = [t for t, _, _ in results if t is not None]
            times, steps = [t for t, _ in reached], [s for _, s in reached]
            table.add_row(name, f"{statistics.median(times):.2f}" if times else "-",
                          f"{statistics.median(steps):g}" if steps else "-",
                          f"{len(times)}/{len(results)}",
                          f"{statistics.median(v for _, v, _ in results):.4f}",
                          f"{statistics.median(w for _, _, w in results):.2f}")
    print_fitted(table)
    print(f"machine: {platform.machine()}, {platform.system()} {platform.release()}, "
          f"python {platform.python_version()}")


if __name__ == "__main__":
    main()
