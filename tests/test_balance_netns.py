"""--balance on real hosts: two namespace hosts, one capped at half a core (cgroup CPU quota).

Each launch trains DDP on digits (a small CNN) with one thread per rank, the hosts capped
at one core and half a core. The fast host waits for the slow one inside every all-reduce;
summary.json's ``collective_share_per_node`` is the measured share of each rank's training
loop spent in collectives. Unbalanced, the fast host waits about half of every step; with
--balance the throughput measured on the warm-up steps gives it about two thirds of the
samples and the wait nearly ends, while the samples seen and the validation loss stay
where they were.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from cpu_limits import CpuGroup, cpu_cgroups, quotas_alone
from ssh_fixtures import free_port, meshtrain

pytestmark = pytest.mark.slow

# On this kind of machine (2 vCPUs of a shared KVM host) each host's speed drifts by 10 to
# 20% over a second or two, independently of the other's (the same 5 warm-up steps took
# 0.21 s of CPU in one run, 0.30 s in the next), and the balancer can only set shares from
# what it has measured. The fast host's mean wait over the balanced steps is then a noisy
# number: over 60 steps it ranged from -0.10 to +0.12 of its loop in 10 runs (CI's failure
# was the +0.12); over 150 steps from -0.04 to +0.03 in 7 runs, 3 of them beside 3 busy loops.
STEPS = 150


@pytest.fixture(scope="module")
def world(netns_hosts: tuple[object, object]) -> tuple[object, object]:
    return netns_hosts  # the session's two namespace hosts (conftest.py)


def _launch(ssh, tmp_path: Path, run_id: str, *extra: str) -> dict:  # noqa: ANN001 - SshWorld
    hosts = [{"name": f"box{i}", "host": s.address, "workdir": str(tmp_path / f"box{i}")}
             for i, s in enumerate(ssh.servers)]
    inventory = ssh.inventory(tmp_path / f"{run_id}.yaml", hosts, iface="eth0",
                              rendezvous={"port": free_port(), "timeout": 120})
    done = meshtrain(ssh, "launch", str(inventory), "--out", str(tmp_path / "runs"), "--run-id", run_id,
                     "--task", "digits", "--set", "task_options.arch=cnn", "--strategy", "ddp",
                     "--steps", str(STEPS), "--batch-size", "256", "--threads", "1", "--no-progress", *extra,
                     cwd=tmp_path, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads((tmp_path / "runs" / run_id / "summary.json").read_text())


def test_balance_ends_the_wait_for_a_host_capped_at_half_a_core(world, tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:  # pinned to one core, both hosts got about half of it
        pytest.skip("needs 2 cores: one host gets a whole core, the other half of one")
    ssh, _ = world
    root, version = cpu_cgroups()
    with quotas_alone():
        fast, slow = CpuGroup(root, version, "fast", 1.0), CpuGroup(root, version, "slow", 0.5)
        try:
            fast.add(ssh.servers[0].pid)  # every rank box0's sshd starts gets at most one core
            slow.add(ssh.servers[1].pid)  # and box1's half a core
            runs = {balance: _launch(ssh, tmp_path, f"balance-{balance}", *(["--balance"] if balance else []))
                    for balance in (False, True)}
        finally:
            fast.delete()
            slow.delete()
    # Share of each rank's loop inside the all-reduce: the unbalanced run's whole loop, the
    # balanced run's steps after its warm-up. The slow host arrives last and waits for no
    # one: its share is the collective's own cost. The fast host's share beyond it is the
    # time it waits for the slow host.
    inside = {False: runs[False]["collective_share_per_node"],
              True: runs[True]["balance"]["collective_share_per_node"]}
    waiting = {b: fast - slow for b, (fast, slow) in inside.items()}
    shares = runs[True]["balance"]["nodes"]
    report = f"in collectives (fast, slow) {inside}, shares {shares}"
    # The fast host waits about half of every step (2x the speed), plus its wait at step 1
    # for the slow host's start: 0.45 to 0.56 of its loop beside 24 busy threads on 2 cores
    # (the groups' top weight keeps their quotas; cpu_limits.py): a clear wait, which
    # --balance must end.
    assert 0.15 < waiting[False] < 0.7, report
    assert waiting[True] < 0.1 and waiting[True] < waiting[False] / 2, report
    assert shares[0]["batch_size"] > shares[1]["batch_size"], report
    assert runs[True]["balance"]["balanced_from_step"] == 7  # after 1 + 5 timed warm-up steps
    # The same samples seen, and the validation loss they reach stays where it was.
    assert runs[True]["examples"] == runs[False]["examples"]
    assert runs[True]["final_val_loss"] == pytest.approx(runs[False]["final_val_loss"], rel=0.15)


LIAR_SITE = """
# A host that controls its account makes its rank claim 1e308 samples/s: the balancer's
# exchange of speeds is the unrecorded float64 all-gather it makes (whatever it is called).
import sys

import torch

import meshtrain.comm.torch_dist as td

_real = td.TorchDistCommunicator.all_gather


def all_gather(self, tensor, group=None, *, record=True):
    caller = sys._getframe(1).f_code.co_name
    if not record and tensor.dtype == torch.float64 and caller in ("measured_shares", "gather_claims"):
        tensor = tensor.clone()
        tensor[0] = 1e308
    return _real(self, tensor, group, record=record)


td.TorchDistCommunicator.all_gather = all_gather
"""

LIAR_PYTHON = """#!/bin/sh
# Training ranks (python -m meshtrain ...) start with the lie loaded; the preflight's checks do not.
if [ "$1" = -m ] && [ "$2" = meshtrain ]; then export PYTHONPATH={site}; fi
exec {python} "$@"
"""


def test_a_rank_claiming_1e308_samples_per_second_is_named_and_the_run_goes_on(world, tmp_path: Path) -> None:
    """box1's rank claims 1e308 samples/s: both ranks crashed with OverflowError and neither
    named the host. Now every rank refuses the claim, rank 0 names rank 1 and the run trains
    on with equal shares."""
    import sys

    ssh, _ = world
    site = tmp_path / "liar-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(LIAR_SITE)
    liar = tmp_path / "liar-python"
    liar.write_text(LIAR_PYTHON.format(site=site, python=sys.executable))
    liar.chmod(0o755)
    hosts = [{"name": f"box{i}", "host": s.address, "workdir": str(tmp_path / f"box{i}")}
             for i, s in enumerate(ssh.servers)]
    hosts[1]["python"] = str(liar)
    inventory = ssh.inventory(tmp_path / "inv.yaml", hosts, iface="eth0",
                              rendezvous={"port": free_port(), "timeout": 120})
    done = meshtrain(ssh, "launch", str(inventory), "--out", str(tmp_path / "runs"), "--run-id", "lied",
                     "--task", "digits", "--strategy", "ddp", "--steps", "10", "--batch-size", "32",
                     "--threads", "1", "--no-progress", "--balance", cwd=tmp_path, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    # Rank 0 says it (on box0's line), naming the rank and the host that lied.
    refusal = "rank 1 (box1) claimed 1e+308 samples/s over its windows, beside steps of "
    assert re.search(rf"^box0 r0 \| warning: --balance: {re.escape(refusal)}[\d.e+-]+ s: its claims are "
                     r"refused, every node takes equal shares$", output, re.M), output[-3000:]
    summary = json.loads((tmp_path / "runs" / "lied" / "summary.json").read_text())
    assert summary["balance"]["refused"].startswith(refusal)
    assert [n["batch_size"] for n in summary["balance"]["nodes"]] == [32, 32]
