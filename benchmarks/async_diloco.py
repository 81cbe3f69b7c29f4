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

With ``--launched`` the same three run as ``meshtrain launch`` on two namespace hosts with
their own sshd (tests/ssh_fixtures.py), one capped at a third of the other's CPU by cgroup
quotas (tests/cpu_limits.py: 1 core and 1/3 core), digits with the small CNN, one torch
thread per rank; the time is real: metrics.csv's ``seconds`` at the first validation at or
below the target, counted from the end of step 1 (start-up left out). Needs root,
openssh-server, iproute2 and a writable cgroup cpu controller.

    python benchmarks/async_diloco.py                      # seeds 0-2, 300 steps, target 0.45
    python benchmarks/async_diloco.py --seeds 0 1 2 3 4 --target 0.4
    python benchmarks/async_diloco.py --launched --steps 200 --val-interval 10 --target 0.3
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

#: (seconds and step at the target or None, final val loss, seconds at the last step)
Result = tuple[tuple[float, int] | None, float, float]

RUNS = {
    "diloco": ["--strategy", "diloco"],
    "diloco --balance": ["--strategy", "diloco", "--balance"],
    "async-diloco": ["--strategy", "async-diloco"],
}


def _simulate(out: Path, name: str, seed: int, args: argparse.Namespace) -> Result:
    """((projected seconds, step) at the target or None, final val loss, projected total seconds)."""
    run_id = f"{name.replace(' ', '').replace('-', '')}-{seed}"
    command = [sys.executable, "-m", "meshtrain", "simulate", *RUNS[name], "--nodes", "2",
               "--steps", str(args.steps), "--seed", str(seed), "--val-interval", str(args.val_interval),
               "--straggler", "node=1,slowdown=3", "--step-seconds", str(args.step_seconds),
               "--cluster", args.cluster, "--out", str(out), "--run-id", run_id, "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"$ {' '.join(command)}\n{(done.stdout + done.stderr)[-3000:]}")
    return _read(out / run_id, args.target, "projected_seconds")


class _Folders:
    """What ``netns_world`` needs of pytest's tmp_path_factory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def mktemp(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=name, dir=self.root))


def _launched(folder: Path, args: argparse.Namespace) -> dict[str, list[Result]]:
    """Each strategy launched on two namespace hosts, one capped at a third of the other's CPU."""
    import pytest

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from cpu_limits import CpuGroup, cpu_cgroups
    from ssh_fixtures import free_port, meshtrain, netns_world

    worlds = netns_world(_Folders(folder))  # type: ignore[arg-type]
    try:
        ssh, _ = next(worlds)
    except pytest.skip.Exception as exc:  # sshd or another tool of the world is missing
        raise SystemExit(f"cannot run here: {exc}") from None
    results: dict[str, list[Result]] = {name: [] for name in RUNS}
    try:
        root, version = cpu_cgroups()
        fast, slow = CpuGroup(root, version, "fast", 1.0), CpuGroup(root, version, "slow", 1 / 3)
        try:
            fast.add(ssh.servers[0].pid)
            slow.add(ssh.servers[1].pid)
            hosts = [{"name": f"box{i}", "host": s.address, "workdir": str(folder / f"box{i}")}
                     for i, s in enumerate(ssh.servers)]
            for seed in args.seeds:
                for name in RUNS:
                    run_id = f"{name.replace(' ', '').replace('-', '')}-{seed}"
                    inventory = ssh.inventory(folder / f"{run_id}.yaml", hosts, iface="eth0",
                                              rendezvous={"port": free_port(), "timeout": 300})
                    done = meshtrain(ssh, "launch", str(inventory), "--out", str(folder / "runs"),
                                     "--run-id", run_id, *RUNS[name], "--task", "digits",
                                     "--set", "task_options.arch=cnn", "--steps", str(args.steps),
                                     "--seed", str(seed), "--batch-size", str(args.batch_size),
                                     "--val-interval", str(args.val_interval),
                                     "--threads", "1", "--no-progress", cwd=folder, timeout=1800)
                    if done.returncode != 0:
                        raise SystemExit((done.stdout + done.stderr)[-4000:])
                    results[name].append(_read(folder / "runs" / run_id, args.target, "seconds"))
        finally:
            fast.delete()
            slow.delete()
    finally:
        worlds.close()
    return results


def _read(run: Path, target: float, clock: str) -> Result:
    """((``clock`` seconds, step) at the first validation at or below ``target`` or None, final
    val loss, ``clock`` seconds at the last step)."""
    with (run / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["step"] != "0"]
    # Real seconds count from the end of step 1 (start-up, the same for every strategy, and the
    # first step's one-off costs left out); the projection's from zero.
    zero = float(rows[0][clock]) if clock == "seconds" else 0.0
    reached = next(((float(r[clock]) - zero, int(r["step"])) for r in rows
                    if r["val_loss"] and float(r["val_loss"]) <= target), None)
    summary = json.loads((run / "summary.json").read_text())
    return reached, float(summary["final_val_loss"]), float(rows[-1][clock]) - zero


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--target", type=float, default=0.45)
    parser.add_argument("--val-interval", type=int, default=5)
    parser.add_argument("--step-seconds", type=float, default=0.01)
    parser.add_argument("--cluster", default="gbe")
    parser.add_argument("--launched", action="store_true",
                        help="two namespace hosts, one capped at 1/3 of the other's CPU: real seconds")
    parser.add_argument("--batch-size", type=int, default=128, help="--launched: per host")
    args = parser.parse_args()
    seeds = ", ".join(map(str, args.seeds))
    title = (f"digits CNN launched on 2 namespace hosts, 1 core and 1/3 core: seconds to val loss <= "
             f"{args.target} ({args.steps} steps, batch {args.batch_size}; median of seeds {seeds})"
             if args.launched else
             f"digits, 2 nodes, node 1 3x slower: projected seconds to val loss <= {args.target} "
             f"({args.steps} steps, step {args.step_seconds} s, {args.cluster}; median of seeds {seeds})")
    table = Table(title=title)
    for column in ("strategy", "to target (s)", "at step", "reached", "final val loss", "whole run (s)"):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    with tempfile.TemporaryDirectory() as tmp:
        launched = _launched(Path(tmp), args) if args.launched else {}
        for name in RUNS:
            results = launched[name] if args.launched else [_simulate(Path(tmp), name, seed, args)
                                                             for seed in args.seeds]
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
