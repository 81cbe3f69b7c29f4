"""The multi-host test of record: two hosts, each a Linux network namespace with its own
sshd and its own address (10.200.0.10, 10.200.0.11), the launcher in a third namespace.

* Launching DiLoCo on the two hosts gives bit-identical weights to
  ``meshtrain simulate --nodes 2`` with the same options, the same thread count included
  (floating-point sums are grouped differently at 1 and 2 threads). Simulated on threads:
  the processes runtime gives the same weights bit for bit (tests/test_runtimes.py) for
  two more interpreters' start-up.
* ``hosts check`` reaches rank 0's rendezvous port from both hosts.
* An address where no host answers is a one-line error before anything starts.
* A host whose network drops mid-run is noticed by its missing heartbeats, and the other
  rank is stopped.

Skipped (with the reason) where namespaces or sshd cannot be had.
"""

from __future__ import annotations

import re
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from in_process import meshtrain_here
from ssh_fixtures import (
    Namespaces,
    SshWorld,
    meshtrain,
    rank_processes,
    read_until,
    start_meshtrain,
    wait_until_gone,
)

pytestmark = pytest.mark.slow
# --threads 1 on both sides: like with like on any machine (simulate's default is 1 per node,
# a launched rank's is every core of its host).
TRAINING = ["--task", "digits", "--strategy", "diloco", "--steps", "20", "--set", "H=5", "--seed", "3",
            "--batch-size", "16", "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def world(netns_hosts: tuple[SshWorld, Namespaces]) -> tuple[SshWorld, Namespaces]:
    return netns_hosts  # the session's two namespace hosts (conftest.py)


def inventory(world: SshWorld, tmp_path: Path, extra_host: dict | None = None) -> Path:
    hosts = [{"name": f"box{i}", "host": s.address, "workdir": str(tmp_path / f"box{i}")}
             for i, s in enumerate(world.servers)]
    if extra_host:
        hosts.append(extra_host)
    return world.inventory(tmp_path / "inv.yaml", hosts, iface="eth0",
                           rendezvous={"port": 29500, "timeout": 60})


def test_launch_on_two_hosts_matches_simulate_bit_for_bit(world, tmp_path: Path) -> None:
    ssh, _ = world
    inv = inventory(ssh, tmp_path)
    launched = meshtrain(ssh, "launch", str(inv), "--out", str(tmp_path / "runs"), "--run-id", "two-hosts",
                         *TRAINING, cwd=tmp_path, timeout=240)
    run_id = "two-hosts"
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert f"box0 r0 | run directory: runs/{run_id}" in launched.stdout.splitlines(), launched.stdout
    assert "box1 r1 | " in launched.stdout
    local = tmp_path / "runs" / run_id
    assert {"config.yaml", "metrics.csv", "summary.json", "model.pt"} <= {p.name for p in local.iterdir()}
    assert yaml.safe_load((local / "config.yaml").read_text())["train"]["threads"] == 1  # recorded

    # In this process, on threads (bit-identical to processes: tests/test_runtimes.py).
    simulated = meshtrain_here("simulate", "--nodes", "2", "--runtime", "threads", "--device", "cpu",
                               "--out", str(tmp_path / "sim"), "--run-id", "sim", *TRAINING, cwd=tmp_path,
                               timeout=240)
    assert simulated.returncode == 0, simulated.stderr
    a = torch.load(local / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "sim" / "sim" / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs between launch and simulate"


def test_hosts_check_across_namespaces(world, tmp_path: Path) -> None:
    ssh, _ = world
    result = meshtrain(ssh, "hosts", "check", str(inventory(ssh, tmp_path)), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok reached") == 2 and "all 2 hosts ready" in result.stdout


def test_hosts_check_finds_a_rendezvous_port_no_host_can_reach(world, tmp_path: Path) -> None:
    """The firewall case: rank 0 answers SSH, but its rendezvous address cannot be reached
    (here: it advertises an address nobody has, so connections go unanswered)."""
    ssh, _ = world
    inv = inventory(ssh, tmp_path)
    inv.write_text(inv.read_text().replace("name: box0", "name: box0\n  advertise: 10.200.0.50"))
    result = meshtrain(ssh, "hosts", "check", str(inv), cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    for name in ("box0", "box1"):
        assert re.search(rf"^{name}: rendezvous: cannot connect to 10\.200\.0\.50:29500 .*firewall",
                         result.stderr, re.M), result.stderr
    assert "ssh: " not in result.stderr  # everything else passed


def test_unreachable_address_fails_before_anything_starts(world, tmp_path: Path) -> None:
    ssh, _ = world
    inv = inventory(ssh, tmp_path, {"name": "ghost", "host": "10.200.0.99"})  # nobody there
    marker = tmp_path / "box0" / "started"
    started = time.monotonic()
    result = meshtrain(ssh, "launch", str(inv), "--", "touch", str(marker), cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert re.search(r"ghost \(root@10\.200\.0\.99:22\): (cannot reach port 22 \(no route to host\)"
                     r"|no answer within)", errors[0]), errors[0]
    assert not marker.exists()
    assert time.monotonic() - started < 30


SLEEPER = textwrap.dedent("""
    import os, sys, time
    print("rank", os.environ["RANK"], "ready", flush=True)
    time.sleep(600)
""")


def test_host_dropping_off_the_network_stops_the_run(world, tmp_path: Path) -> None:
    ssh, ns = world
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    marker = f"mt-drop-{uuid.uuid4().hex[:10]}"
    proc = start_meshtrain(ssh, "launch", str(inventory(ssh, tmp_path)), "--upload", str(script), "--",
                           "python", "sleeper.py", marker, cwd=tmp_path)
    try:
        read_until(proc, ["rank 0 ready", "rank 1 ready"], timeout=30)
        ns.set_link(ns.hosts[1], up=False)  # box1's cable is pulled
        try:  # without the heartbeat the run would sleep on for 600 s: TimeoutExpired here
            output, _ = proc.communicate(timeout=60)
        finally:
            ns.set_link(ns.hosts[1], up=True)
    finally:
        proc.kill()
    assert proc.returncode == 1, output
    # Noticed by the missing heartbeats (6 s here), not by a connection timing out (the
    # silence as measured when the launcher's poll saw it: 6 s, or 7 after a late poll).
    silent = re.search(r"rank 1 on box1 stopped answering for (\d+) s", output)
    assert silent and 6 <= int(silent[1]) < 10, output
    # Rank 0 was stopped by the launcher; rank 1, cut off, ends when its sshd gives up on
    # the dead session (ClientAliveInterval 5 x 3 here) or the reconnected network resets it.
    assert "could not confirm these ranks stopped: rank 1 on box1" in output
    assert not [p for p in rank_processes(marker, "sleeper.py") if _rank_of(p) == 0]
    left = wait_until_gone(marker, timeout=90)
    assert not left, left


def _rank_of(ps_line: str) -> int | None:
    try:
        env = Path(f"/proc/{ps_line.split()[0]}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e[5:]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None
