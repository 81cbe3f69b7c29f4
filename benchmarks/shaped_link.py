"""Wall-clock on real hosts over a 100 Mbit/s link: DiLoCo against its overlapped and
compressed variants, measured and projected (issue 46, item 6).

Two hosts, each a Linux network namespace with its own sshd pinned to its own core (every
rank inherits the core), one torch thread per rank. Each host's eth0 is left unshaped, then
shaped with a tc token bucket (``tbf``; this kernel has no ``netem``) to 100 Mbit/s. Per link:

1. ``meshtrain hosts bench`` measures the two hosts' bandwidth and latency into a cluster file;
2. the gpt task with a model of 5,373,696 parameters (3 layers, dim 384, vocabulary 65;
   batch 4 of 64 characters per host) is launched with ``meshtrain launch`` for every row:
   DiLoCo, streaming DiLoCo (F=4 fragments, tau=5 overlapped steps), DiLoCo with its outer
   step delayed one round (``delay=1``) and DiLoCo with int8 outer gradients, all at H=15,
   the projection on that cluster file;
3. per row: the measured wall-clock of the steady rounds (from the end of round 1 to the end
   of round ROUNDS - 1: the first round's start-up and the last round's end-of-training
   syncs are left out), the run's own projection of the same steps (metrics.csv's
   ``projected_seconds``: its measured compute per step plus the projected communication on
   the measured link) and their ratio, the wall-clock over unshaped DiLoCo's, and the seconds
   rank 0 spent waiting in collectives (a sync that overlapped training only counts what
   was left when it was needed).

    sudo python benchmarks/shaped_link.py                 # 2 repeats of 7 launches, ~15 min
    sudo python benchmarks/shaped_link.py --repeats 1 --nice -10
    sudo python benchmarks/shaped_link.py --collectives     # the collectives alone, ~1 min

Needs root (namespaces, tc), sshd and iproute2; refuses in one line otherwise. The load
average is printed with every run: the hosts' cores are shared with whatever else runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_sampler import THREAD_NAMER  # noqa: E402
from scaling import meshtrain, shape, start_pinned_sshds, write_text_data  # noqa: E402  (the namespace-host benchmark's helpers)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import pytest  # noqa: E402  (ssh_fixtures skips through pytest where it cannot run)
import yaml  # noqa: E402
from ssh_fixtures import PYTHON, SshWorld, make_namespaces, new_world  # noqa: E402

H = 15
ROUNDS = 6  # steps = ROUNDS * H; rounds 2 .. ROUNDS - 1 are timed
MODEL = ["--set", "task_options.dim=384", "--set", "task_options.layers=3", "--batch-size", "4"]
#: name -> (label, strategy, --set items)
ROWS = {
    "diloco": ("DiLoCo", "diloco", ()),
    "streaming": ("Streaming F=4 tau=5", "streaming-diloco", ("fragments=4", "tau=5")),
    "delay": ("DiLoCo delay=1", "diloco", ("delay=1",)),
    "int8": ("DiLoCo int8", "diloco", ("compression=int8",)),
}
#: The launches of one repeat, in order: (link, row). Unshaped DiLoCo is every row's baseline.
ORDER = (("unshaped", "diloco"), ("100mbit", "diloco"), ("100mbit", "streaming"), ("100mbit", "delay"),
         ("100mbit", "int8"), ("unshaped", "streaming"), ("unshaped", "delay"))


#: Loaded into every rank (sitecustomize, with THREAD_NAMER): at exit, the CPU seconds of each
#: of its threads by kernel name, the main thread (which trains) as "main" (user) and "main
#: system", into $MESHTRAIN_CPU_DIR/rank<R>.json.
CPU_BY_THREAD = """
import atexit, json, os
if os.environ.get("MESHTRAIN_CPU_DIR") and os.environ.get("RANK"):
    def _save():
        tick, pid, by_name = os.sysconf("SC_CLK_TCK"), os.getpid(), {}
        for tid in os.listdir("/proc/self/task"):
            try:
                text = open(f"/proc/self/task/{tid}/stat").read()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2:].split()
            if int(tid) == pid:  # user and system apart: the kernel's network work shows as system
                by_name["main"], by_name["main system"] = int(fields[11]) / tick, int(fields[12]) / tick
                continue
            name = text[text.index("(") + 1:text.rindex(")")]
            by_name[name] = by_name.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        path = os.path.join(os.environ["MESHTRAIN_CPU_DIR"], "rank%s.json" % os.environ["RANK"])
        with open(path, "w") as f:
            json.dump(by_name, f)
    atexit.register(_save)
"""


#: ``--collectives``: run in each host namespace as rank argv[1] of 2 (no sshd, no launcher):
#: rank 0 prints the median seconds of 4 of each collective, the payloads of the table's rows.
COLLECTIVES = """
import os, statistics, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
torch.set_num_threads(1)
rank = int(sys.argv[1])
os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
dist.init_process_group("gloo", init_method="tcp://%s:29555" % sys.argv[2], rank=rank, world_size=2,
                        timeout=timedelta(seconds=120))
from meshtrain.comm.torch_dist import TorchDistCommunicator
comm = TorchDistCommunicator()

def timed(work):
    seconds = []
    for _ in range(4):
        dist.barrier()
        started = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)

model = torch.randn(5_373_696)  # the gpt model's outer gradient, fp32: 21.5 MB
same = torch.randn(1_385_406)  # fp32 of int8's payload bytes
payload = torch.randint(0, 255, (5_541_624,), dtype=torch.uint8)  # int8 with its scales
times = {
    "all-reduce 21.5 MB (meshtrain)": timed(lambda: comm.all_reduce(model.clone(), record=False)),
    "all-reduce 5.54 MB (meshtrain)": timed(lambda: comm.all_reduce(same.clone(), record=False)),
    "all-gather 5.54 MB (meshtrain)": timed(lambda: comm.all_gather(payload, record=False)),
    "all-gather 5.54 MB (gloo's dist.all_gather)": timed(
        lambda: dist.all_gather([torch.empty_like(payload) for _ in range(2)], payload)),
}
if rank == 0:
    for name, seconds in times.items():
        print("%s | %.3f" % (name, seconds), flush=True)
dist.destroy_process_group()
"""


def collectives() -> None:
    """``--collectives``: the table's collectives alone on the shaped link, rank by rank."""
    cores = sorted(os.sched_getaffinity(0))
    print(f"$ uptime: {uptime()}", flush=True)
    ns = make_namespaces(2)
    try:
        shape(ns, "100mbit")
        print("collective (2 hosts, 100 Mbit/s tbf) | median of 4, s")
        print("--- | ---")
        ranks = [subprocess.Popen(["ip", "netns", "exec", host, "taskset", "-c", str(cores[i % len(cores)]),
                                   PYTHON, "-c", COLLECTIVES, str(i), ns.addresses[ns.hosts[0]]])
                 for i, host in enumerate(ns.hosts)]
        for rank in ranks:
            rank.wait(timeout=600)
    finally:
        ns.delete()


@dataclass
class Row:
    link: str
    row: str
    measured: float  # wall-clock seconds of the timed rounds
    projected: float  # the run's projection of the same steps
    compute: float  # of it: the run's measured compute per step (CPU time) times the timed steps
    waited: float  # rank 0's seconds inside collectives, whole run (overlapped ones: only the wait)
    load: float
    #: rank 0's CPU seconds, whole run: the training thread (user, system), the side channel's
    #: worker, the rest (gloo's and torch's own threads, the heartbeat)
    cpu: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)


def python(folder: Path, nice: int) -> Path:
    """The hosts' interpreter: this one, its session's scheduling group at ``nice`` first.

    With the kernel's autogroups (``/proc/sys/kernel/sched_autogroup_enabled``) every session
    (each SSH login is one) is one group sharing the cores equally with every other group, and
    a process's own nice value counts only inside its group: the group's must change."""
    wrapper = folder / "python"
    wrapper.write_text(f"#!/bin/sh\necho {nice} > /proc/self/autogroup 2>/dev/null\nexec {PYTHON} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def launch(world: SshWorld, folder: Path, inv: Path, row: str, link: str, cluster: Path, data: Path,
           run_id: str) -> Row:
    _, strategy, sets = ROWS[row]
    steps = ROUNDS * H
    load = os.getloadavg()[0]
    shutil.rmtree(folder / "cpu", ignore_errors=True)
    (folder / "cpu").mkdir()
    meshtrain(world, "launch", str(inv), "--out", str(folder / "runs"), "--run-id", run_id,
              "--task", "gpt", "--data", str(data), "--strategy", strategy, "--steps", str(steps),
              "--threads", "1", "--val-interval", str(steps), "--no-ship", *MODEL,
              "--set", f"H={H}", "--set", f"cluster={cluster}", *(x for s in sets for x in ("--set", s)),
              cwd=folder)
    run = folder / "runs" / run_id
    summary = json.loads((run / "summary.json").read_text())
    with open(run / "metrics.csv") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f) if r["seconds"]}
    first, last = H, (ROUNDS - 1) * H  # metrics.csv's rows after round 1 and round ROUNDS - 1

    def span(key: str) -> float:
        return float(rows[last][key]) - float(rows[first][key])

    projected = summary["projected"]
    threads = json.loads((folder / "cpu" / "rank0.json").read_text())
    side = threads.pop("beside-training", 0.0)
    main, system = threads.pop("main"), threads.pop("main system")
    return Row(link, row, span("seconds"), span("projected_seconds"),
               projected["step_seconds"] * (last - first), projected["measured_communication_seconds"],
               load, (main, system, side, sum(threads.values())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--nice", type=int, default=0,
                        help="nice value of each rank's scheduling group (-10: the hosts stand for "
                             "dedicated machines, other work on this machine takes less of their cores)")
    parser.add_argument("--collectives", action="store_true",
                        help="instead: the rows' collectives alone on the 100 Mbit/s link (all-reduce of "
                             "the model, all-reduce and all-gather of int8's payload bytes)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("benchmarks/shaped_link.py needs root: it creates network namespaces, sshd and tc qdiscs")
    try:
        if args.collectives:
            collectives()
        else:
            measure(args.repeats, args.nice)
    except pytest.skip.Exception as exc:  # a tool the hosts need is missing (ip, sshd, ssh-keygen)
        sys.exit(f"cannot run here: {exc}")


def measure(repeats: int, nice: int) -> None:
    cores = sorted(os.sched_getaffinity(0))
    print(f"$ uptime: {uptime()}", flush=True)
    ns = make_namespaces(2)
    results: list[Row] = []
    clusters: dict[str, tuple[Path, str]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="meshtrain-shaped-") as tmp:
            folder = Path(tmp)
            world = new_world(folder / "ssh")
            world.client_netns = ns.client
            try:
                start_pinned_sshds(world, ns, cores)
                data = folder / "text.txt"
                write_text_data(data)
                hosts = [{"name": f"box{i}", "host": s.address, "workdir": str(folder / f"box{i}")}
                         for i, s in enumerate(world.servers)]
                (folder / "site").mkdir()
                (folder / "site" / "sitecustomize.py").write_text(THREAD_NAMER + CPU_BY_THREAD)
                env = {"PYTHONPATH": str(folder / "site"), "MESHTRAIN_CPU_DIR": str(folder / "cpu")}
                inv = world.inventory(folder / "hosts.yaml", hosts, iface="eth0", env=env,
                                      python=str(python(folder, nice)),
                                      rendezvous={"port": 29500, "timeout": 120})
                for link in ("unshaped", "100mbit"):
                    shape(ns, link)
                    cluster = folder / f"cluster-{link}.yaml"
                    meshtrain(world, "hosts", "bench", str(inv), "--out", str(cluster), "--name", link,
                              "--max-size", "32MB", cwd=folder)
                    fitted = yaml.safe_load(cluster.read_text())
                    clusters[link] = (cluster, f"{fitted['bandwidth'] / 1e6:.2f} MB/s, "
                                               f"{fitted['latency'] * 1e3:.2f} ms")
                    print(f"[{link}] hosts bench: {clusters[link][1]}", flush=True)
                for r in range(repeats):
                    for link, row in ORDER:
                        shape(ns, link)
                        result = launch(world, folder, inv, row, link, clusters[link][0], data,
                                        f"{link}-{row}-{r}")
                        results.append(result)
                        print(f"[{link}] {ROWS[row][0]} run {r + 1}: measured {result.measured:.2f} s, "
                              f"projected {result.projected:.2f} s (compute {result.compute:.2f} s), "
                              f"waited in collectives {result.waited:.2f} s, rank 0's CPU: training thread "
                              f"{result.cpu[0]:.2f} s user + {result.cpu[1]:.2f} s system, side channel "
                              f"{result.cpu[2]:.2f} s, other threads {result.cpu[3]:.2f} s "
                              f"(load {result.load:.2f})",
                              flush=True)
            finally:
                for server in world.servers:
                    server.stop()
    finally:
        ns.delete()
    print(f"$ uptime: {uptime()}")
    print_table(results, {link: text for link, (_, text) in clusters.items()}, nice)


def print_table(results: list[Row], clusters: dict[str, str], nice: int) -> None:
    def med(link: str, row: str, key: str) -> float:
        def value(r: Row) -> float:
            parts = {"system": r.cpu[1], "side": r.cpu[2], "other": r.cpu[3]}
            return parts[key] if key in parts else float(getattr(r, key))

        return statistics.median(value(r) for r in results if (r.link, r.row) == (link, row))

    runs = len(results) // len(ORDER)
    print(f"\n2 namespace hosts (nice {nice}), gpt 5,373,696 parameters, batch 4 x 64, H={H}; "
          f"{(ROUNDS - 2) * H} timed steps (rounds 2-{ROUNDS - 1} of {ROUNDS}); medians of {runs} runs")
    for link, fitted in clusters.items():
        print(f"  {link}: hosts bench measured {fitted}")
    base = med("unshaped", "diloco", "measured")
    # Unshaped DiLoCo's wall-clock less its projected communication: the compute as the hosts
    # really got it under this machine's load (the projection counts the rank's CPU time).
    wall_compute = base - (med("unshaped", "diloco", "projected") - med("unshaped", "diloco", "compute"))
    header = ("link", "run", "measured s", "projected s", "projected / measured", "vs unshaped DiLoCo",
              "vs same run unshaped", "compute (CPU) s", "waited in collectives s",
              "projected, compute as unshaped DiLoCo's wall / measured",
              "rank 0 CPU s: training thread's system / side channel / gloo and other threads", "load")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for link, row in sorted(set(ORDER), key=lambda x: (x[0] != "unshaped", list(ROWS).index(x[1]))):
        measured, projected, compute = (med(link, row, k) for k in ("measured", "projected", "compute"))
        same = med("unshaped", row, "measured") if ("unshaped", row) in ORDER else float("nan")
        loads = [r.load for r in results if (r.link, r.row) == (link, row)]
        print(f"{link} | {ROWS[row][0]} | {measured:.2f} | {projected:.2f} | {projected / measured:.2f} | "
              f"{measured / base:.2f}x | {measured / same:.2f}x | {compute:.2f} | "
              f"{med(link, row, 'waited'):.2f} | {(wall_compute + projected - compute) / measured:.2f} | "
              f"{' / '.join(f'{med(link, row, k):.2f}' for k in ('system', 'side', 'other'))} | "
              f"{min(loads):.1f}-{max(loads):.1f}")
    shaped = med("100mbit", "diloco", "measured")
    projected = med("100mbit", "diloco", "projected")
    projected_sync = projected - med("100mbit", "diloco", "compute")
    print(f"plain DiLoCo's sync on 100mbit: measured {(shaped - base) / shaped:.0%} of a round "
          f"(shaped less unshaped wall-clock), projected {projected_sync / projected:.0%}")


if __name__ == "__main__":
    main()
