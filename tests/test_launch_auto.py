"""``launch --strategy auto`` on two namespace hosts (real sshd, real gloo), links shaped with tc.

``hosts bench --task gpt`` measures the link and times the gpt model on each host (the
compute probe), then ``launch --strategy auto`` plans from that cluster file:

* unshaped (a fast link), the small gpt model gets DDP (unless the hosts' steps vary so
  much, on a loaded machine, that waiting for the slowest at every step rules DDP out);
* at 50 Mbit/s, the same model gets DiLoCo with the smallest H that keeps communication
  within 10% of a step.

The choice and its reasons are in the run's config.yaml; the ranks projected onto the
measured cluster. Whether the projected speedup matches a measured one is checked by
``benchmarks/scaling.py`` (it needs repeated 100-step runs: minutes, and a quiet machine).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import yaml
from ssh_fixtures import Namespaces, SshWorld, meshtrain, rate_limited

from meshtrain.cluster import get_cluster, sync_wait_seconds
from meshtrain.planning import COMM_BUDGET, DILOCO_H, ddp_all_reduce_seconds

pytestmark = pytest.mark.slow
BATCH = "64"  # a step long enough that a fast link's all-reduce is a small share of it
#: On the slow link: a quarter of the step, so a sync weighs even more on it (DiLoCo all the
#: more), and the compute probe takes a quarter of the time.
SLOW_BATCH = "16"


def text_file(path: Path) -> Path:
    """40,000 characters over 65 symbols: the gpt task's model has 413,312 parameters."""
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(33, 96)] + [" ", "\n"]
    path.write_text("".join(alphabet) + "".join(rng.choice(alphabet) for _ in range(40_000)))
    return path


def plan_and_launch(world: SshWorld, folder: Path, name: str, *, batch: str = BATCH,
                    max_size: str = "8MB") -> dict:
    """``hosts bench`` (with the probe, all-reduces up to ``max_size``) into clusters/NAME.yaml,
    then a short auto launch at ``batch``; returns the run's config.yaml."""
    data = text_file(folder / "text.txt")
    hosts = [{"name": f"box{i}", "host": s.address, "workdir": str(folder / f"box{i}")}
             for i, s in enumerate(world.servers)]
    inv = world.inventory(folder / f"{name}.yaml", hosts, iface="eth0", threads=1,
                          rendezvous={"port": 29520, "timeout": 60})
    bench = meshtrain(world, "hosts", "bench", str(inv), "--min-size", "64KB", "--max-size", max_size,
                      "--points", "4", "--repeats", "3", "--task", "gpt", "--data", str(data),
                      "--batch-size", batch, cwd=folder, timeout=240)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    cluster = get_cluster(str(folder / "clusters" / f"{name}.yaml"))
    assert cluster.probe == f"task gpt, batch {batch}, threads 1" and cluster.step_seconds, cluster
    launched = meshtrain(world, "launch", str(inv), "--strategy", "auto", "--task", "gpt",
                         "--data", str(data), "--batch-size", batch, "--steps", "3", "--val-interval", "3",
                         "--no-progress", "--out", str(folder / "runs"), "--run-id", name,
                         cwd=folder, timeout=240)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    config = yaml.safe_load((folder / "runs" / name / "config.yaml").read_text())
    plan = config["plan"]
    assert f"--strategy auto chose {plan['strategy']}" in launched.stdout
    assert plan["cluster"] == name and plan["hosts"] == 2 and plan["trainable_parameters"] == 413_312
    assert plan["step_seconds"] == pytest.approx(cluster.step_seconds)
    assert config["strategy"]["name"] == plan["strategy"]  # the ranks trained what was chosen
    summary = json.loads((folder / "runs" / name / "summary.json").read_text())
    assert summary["projected"]["cluster"] == name  # projected onto the shipped cluster file
    assert summary["projected"]["measured_communication_seconds"] > 0
    # Rank 0's printed summary shows both, side by side.
    assert re.search(r"communication measured +│ +[\d.]+ s \(projected [\d.]+ s\)", launched.stdout), \
        launched.stdout
    return config


@pytest.fixture(scope="module")
def world(netns_hosts: tuple[SshWorld, Namespaces]) -> tuple[SshWorld, Namespaces]:
    return netns_hosts  # the session's two namespace hosts (conftest.py)


def test_fast_link_gets_ddp(world, tmp_path: Path) -> None:
    """On a quiet machine the link costs DDP a few percent of a step and the probe's spread
    adds a small wait for the slowest host: DDP. Where other processes share the hosts'
    cores, a step varies by a quarter of itself (DDP would wait ~15% of every step) and the
    veth link, moved by those cores, measures slower too (in CI once: 11.8 ms for the
    all-reduce, 5.6% of the step): DiLoCo is then the right choice, and the reasons say
    what DDP would cost, waiting included. Either way the choice is the planner's rule
    applied to what `hosts bench` measured."""
    ssh, _ = world
    config = plan_and_launch(ssh, tmp_path, "fast")
    plan = config["plan"]
    cluster = get_cluster(str(tmp_path / "clusters" / "fast.yaml"))
    step = plan["step_seconds"]
    wait = sync_wait_seconds(1, 2, cluster)
    # What the planner charges DDP: its buckets, hidden behind the backward pass where they fit.
    ddp = ddp_all_reduce_seconds(plan["trainable_parameters"] * 4, 2, cluster, step)
    if (ddp + wait) / (step + ddp + wait) <= COMM_BUDGET:
        assert plan["strategy"] == "ddp", plan
        assert plan["communication_share"] <= COMM_BUDGET
        assert any("no quality cost" in reason for reason in plan["reasons"])
    else:  # a busy machine: the hosts' spread (and a link slowed with them) rule DDP out
        assert plan["strategy"] == "diloco", (plan, cluster)
        assert any(reason.startswith("DDP would spend") for reason in plan["reasons"]), plan
        assert any("waiting for the slowest host" in reason for reason in plan["reasons"]) == (wait > 0), plan


def test_slow_link_gets_diloco_with_communication_under_budget(world, tmp_path: Path) -> None:
    ssh, ns = world
    with rate_limited(ns, "50mbit"):
        # 2 MB is 30x the 64 KB all-reduce at 50 Mbit/s (8 MB is needed only where the link is fast).
        config = plan_and_launch(ssh, tmp_path, "slow", batch=SLOW_BATCH, max_size="2MB")
    plan = config["plan"]
    assert plan["strategy"] == "diloco", plan
    h = plan["strategy_options"]["H"]
    assert h in DILOCO_H and config["strategy"]["H"] == h, config["strategy"]
    assert plan["communication_share"] <= COMM_BUDGET
    assert any(f"DiLoCo H={h} is the smallest H" in reason for reason in plan["reasons"])
