"""How long a fast host waits for a slow one, with and without ``--balance``.

Two namespace hosts with their own sshd (tests/ssh_fixtures.py, as the tests build them),
capped by cgroup CPU quotas at 1 core and 0.5 core (tests/cpu_limits.py). Each run is a
real ``meshtrain launch``: DDP on digits (a small CNN), one torch thread per rank. Per
rank, summary.json gives the share of its training loop spent inside the all-reduce (the
medians of the repeats are shown); the slow host arrives last and waits for no one, so its
share is the collective's own cost, and the fast host's share beyond it is its wait for
the slow host (negative: the slow host waited for the fast one). With ``--balance`` the
shares count from the first balanced step (after the warm-up steps). Needs root,
openssh-server, iproute2 and a writable cgroup cpu controller.

    python benchmarks/balance_wait.py                 # 3 repeats, 120 steps, batch 256
    python benchmarks/balance_wait.py --repeats 5 --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import pytest
from rich.table import Table

from meshtrain.tables import print_fitted

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from cpu_limits import CpuGroup, cpu_cgroups  # noqa: E402
from ssh_fixtures import free_port, meshtrain, netns_world  # noqa: E402


class _Folders:
    """What ``netns_world`` needs of pytest's tmp_path_factory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def mktemp(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=name, dir=self.root))


def _launch(ssh, folder: Path, run_id: str, steps: int, batch: int, balance: bool) -> dict:  # noqa: ANN001
    hosts = [{"name": f"box{i}", "host": s.address, "workdir": str(folder / f"box{i}")}
             for i, s in enumerate(ssh.servers)]
    inventory = ssh.inventory(folder / f"{run_id}.yaml", hosts, iface="eth0",
                              rendezvous={"port": free_port(), "timeout": 300})
    done = meshtrain(ssh, "launch", str(inventory), "--out", str(folder / "runs"), "--run-id", run_id,
                     "--task", "digits", "--set", "task_options.arch=cnn", "--strategy", "ddp",
                     "--steps", str(steps), "--batch-size", str(batch), "--threads", "1",
                     "--no-progress", *(["--balance"] if balance else []), cwd=folder, timeout=1200)
    if done.returncode != 0:
        raise SystemExit((done.stdout + done.stderr)[-4000:])
    return json.loads((folder / "runs" / run_id / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (network namespaces, cgroups)")
    rows: dict[bool, list[tuple[float, float, float, str]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        worlds = netns_world(_Folders(folder))  # type: ignore[arg-type]
        try:
            ssh, _ = next(worlds)
        except pytest.skip.Exception as exc:  # sshd or another tool of the world is missing
            raise SystemExit(f"cannot run here: {exc}") from None
        try:
            root, version = cpu_cgroups()
            fast, slow = CpuGroup(root, version, "fast", 1.0), CpuGroup(root, version, "slow", 0.5)
            try:
                fast.add(ssh.servers[0].pid)
                slow.add(ssh.servers[1].pid)
                for repeat in range(args.repeats):
                    for balance in (False, True):
                        s = _launch(ssh, folder, f"r{repeat}-{balance}", args.steps, args.batch_size, balance)
                        inside = s["balance"]["collective_share_per_node"] if balance \
                            else s["collective_share_per_node"]
                        split = "/".join(str(n["batch_size"]) for n in s["balance"]["nodes"]) if balance \
                            else f"{args.batch_size}/{args.batch_size}"
                        rows[balance].append((inside[0], inside[1], s["final_val_loss"], split))
            finally:
                fast.delete()
                slow.delete()
        finally:
            worlds.close()  # stops the sshds, deletes the namespaces
    table = Table(title=f"DDP on digits (CNN), 2 hosts capped at 1 and 0.5 core, {args.steps} steps, "
                        f"batch {args.batch_size} per host, median of {args.repeats}")
    for name in ("run", "samples/step (fast/slow)", "fast host in the all-reduce",
                 "slow host in the all-reduce", "fast host waiting for the slow one", "final val loss"):
        table.add_column(name, justify="right")
    for balance, found in rows.items():
        table.add_row("--balance" if balance else "equal batches", found[-1][3],
                      f"{statistics.median(r[0] for r in found):.1%}",
                      f"{statistics.median(r[1] for r in found):.1%}",
                      f"{statistics.median(r[0] - r[1] for r in found):.1%}",
                      f"{statistics.median(r[2] for r in found):.4f}")
    print_fitted(table, piped_width=200)


if __name__ == "__main__":
    main()
