"""A launch survives a lost rank: ``--max-restarts`` starts every rank again from the
newest checkpoint all hosts hold, and the run ends exactly where an uninterrupted one does.

Two namespace hosts with real sshd (see ssh_fixtures). Two ways to lose rank 1 mid-run,
each after its first checkpoint: its process is killed (SIGKILL), or its host's network
is cut for a while. Resuming is exact, so the restarted launch's final weights are
bit-identical to ``simulate`` (threads, which equal processes bit for bit) with the same settings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch
from in_process import meshtrain_here
from ssh_fixtures import (
    Namespaces,
    SshWorld,
    meshtrain,
    processes_with,
    read_until,
    start_meshtrain,
)

pytestmark = pytest.mark.slow
TRAINING = ["--task", "digits", "--strategy", "diloco", "--steps", "300", "--set", "H=10", "--seed", "5",
            "--batch-size", "16", "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def world(netns_hosts: tuple[SshWorld, Namespaces]) -> tuple[SshWorld, Namespaces]:
    return netns_hosts  # the session's two namespace hosts (conftest.py)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The same run simulated, never interrupted, in this process: the threads runtime, whose
    result is bit-identical to the processes runtime's (tests/test_runtimes.py pins that; the
    processes runtime's two node interpreters cost ~6 s of CPU here for the same weights)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    done = meshtrain_here("simulate", "--nodes", "2", "--runtime", "threads", "--device", "cpu",
                          "--out", str(out), "--run-id", "sim", *TRAINING, cwd=out, timeout=300)
    assert done.returncode == 0, done.stderr
    return torch.load(out / "sim" / "model.pt", weights_only=True)


def _inventory(ssh: SshWorld, tmp_path: Path) -> Path:
    hosts = [{"name": f"box{i}", "host": s.address, "workdir": str(tmp_path / f"box{i}")}
             for i, s in enumerate(ssh.servers)]
    return ssh.inventory(tmp_path / "inv.yaml", hosts, iface="eth0",
                         rendezvous={"port": 29500, "timeout": 60})


def _wait_for_checkpoint(workdir: Path, run_id: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not list((workdir / "runs" / f"{run_id}.checkpoints").glob("step-*/meta.json")):
        assert time.monotonic() < deadline, f"no checkpoint in {workdir} after {timeout} s"
        time.sleep(0.02)


def _rank_pid(run_id: str, rank: int) -> int:
    for line in processes_with(run_id):
        pid = int(line.split()[0])
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and "-m meshtrain simulate" in line:
            return pid
    raise AssertionError(f"no rank {rank} process of {run_id}")


def _finish(proc: subprocess.Popen[str], seen: str) -> str:
    rest, _ = proc.communicate(timeout=300)
    return seen + rest


def _check_restarted_run(tmp_path: Path, run_id: str, output: str, proc: subprocess.Popen[str],
                         uninterrupted: dict[str, torch.Tensor]) -> None:
    assert proc.returncode == 0, output
    assert "restart 1 of 1: starting every rank again from the last checkpoint" in output, output
    assert f"resuming {run_id} after step " in output, output
    summary = json.loads((tmp_path / "runs" / run_id / "summary.json").read_text())
    assert [r["rank"] for r in summary["restarts"]] == [1]
    assert summary["steps"] == 300
    final = torch.load(tmp_path / "runs" / run_id / "model.pt", weights_only=True)
    assert final.keys() == uninterrupted.keys()
    for name in final:
        assert torch.equal(final[name], uninterrupted[name]), name


def _start_restartable(ssh: SshWorld, tmp_path: Path, run_id: str) -> subprocess.Popen[str]:
    """The launch both tests disturb: checkpoints every 30 steps, one restart allowed."""
    return start_meshtrain(ssh, "launch", str(_inventory(ssh, tmp_path)), "--out", str(tmp_path / "runs"),
                           "--run-id", run_id, "--checkpoint-every", "30", "--max-restarts", "1", *TRAINING,
                           cwd=tmp_path)


def test_killed_rank_restarts_from_the_checkpoint(world, tmp_path: Path, uninterrupted) -> None:
    ssh, _ = world
    run_id = f"killed-{uuid.uuid4().hex[:8]}"  # its ranks are found by it
    proc = _start_restartable(ssh, tmp_path, run_id)
    try:
        _wait_for_checkpoint(tmp_path / "box1", run_id)
        os.kill(_rank_pid(run_id, 1), signal.SIGKILL)
        output = _finish(proc, "")
    finally:
        proc.kill()
    assert "rank 1 on box1 exited with status" in output, output
    _check_restarted_run(tmp_path, run_id, output, proc, uninterrupted)


def test_host_cut_off_the_network_restarts_when_it_is_back(world, tmp_path: Path, uninterrupted) -> None:
    ssh, ns = world
    run_id = f"cut-{uuid.uuid4().hex[:8]}"
    proc = _start_restartable(ssh, tmp_path, run_id)
    try:
        _wait_for_checkpoint(tmp_path / "box1", run_id)
        ns.set_link(ns.hosts[1], up=False)
        try:
            seen = read_until(proc, ["rank 1 on box1 stopped answering"], timeout=60)
        finally:
            ns.set_link(ns.hosts[1], up=True)
        output = _finish(proc, seen)
    finally:
        proc.kill()
    _check_restarted_run(tmp_path, run_id, output, proc, uninterrupted)


def test_resume_names_the_missing_checkpoint(world, tmp_path: Path) -> None:
    ssh, _ = world
    result = meshtrain(ssh, "launch", str(_inventory(ssh, tmp_path)), "--resume", "never-ran", *TRAINING,
                       cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--resume never-ran: no checkpoint that every host holds" in result.stderr


def test_resume_passes_over_a_damaged_newest_checkpoint(world, tmp_path: Path) -> None:
    """A launch stopped after some checkpoints, whose newest checkpoint on one host is then
    damaged (its node file truncated): --resume says it skipped that one and continues
    from the one before, every host's intact, instead of choosing it again and failing on
    the rank every time."""
    ssh, _ = world
    run_id = f"damaged-{uuid.uuid4().hex[:8]}"
    inv = str(_inventory(ssh, tmp_path))
    flags = [*TRAINING, "--out", str(tmp_path / "runs"), "--checkpoint-every", "30", "--keep", "3"]
    proc = start_meshtrain(ssh, "launch", inv, "--run-id", run_id, *flags, cwd=tmp_path)
    try:
        box1 = tmp_path / "box1" / "runs" / f"{run_id}.checkpoints"
        deadline = time.monotonic() + 120
        while len(list(box1.glob("step-*/meta.json"))) < 2:  # one to fall back to
            assert time.monotonic() < deadline, "fewer than 2 checkpoints on box1 after 120 s"
            time.sleep(0.02)
        os.kill(_rank_pid(run_id, 1), signal.SIGKILL)
        stopped = _finish(proc, "")
    finally:
        proc.kill()
    assert proc.returncode == 1, stopped
    box0 = tmp_path / "box0" / "runs" / f"{run_id}.checkpoints"
    steps = [{int(p.parent.name[len("step-"):]) for p in box.glob("step-*/meta.json")}
             for box in (box0, box1)]
    before, newest = sorted(steps[0] & steps[1])[-2:]
    node = box1 / f"step-{newest:06d}" / "node-1.pt"
    node.write_bytes(node.read_bytes()[:100])
    resumed = meshtrain(ssh, "launch", inv, "--resume", run_id, *flags, cwd=tmp_path)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output
    assert (f"skipped the checkpoint at step {newest}: its node file does not match its checksum on box1"
            in output), output
    assert f"resuming {run_id} after step {before} (the newest checkpoint every host holds)" in output, output
    assert json.loads((tmp_path / "runs" / run_id / "summary.json").read_text())["steps"] == 300
