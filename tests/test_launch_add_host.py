"""``meshtrain hosts add``: a host joins a running ``launch --elastic`` (namespace hosts, real sshd).

The launch starts on two hosts of conftest's three-host world; the third is added while
it trains. The launcher checks it over SSH, rank 0 admits its address at the gate and
makes it slot 2, and its rank joins at an outer sync with a peer's state. The bad-input
tests need no hosts.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml
from cpu_limits import held_back
from ssh_fixtures import PYTHON, Namespaces, SshWorld, meshtrain, rank_pid_in, read_until, start_meshtrain
from typer.testing import CliRunner

from meshtrain.cli.main import app
from meshtrain.hosts.inventory import load_inventory
from meshtrain.launch.adding import RunControl

#: Steps of the launch. From its first step until the added host is in, rank 0 is held to
#: HELD_CORES of a core (a cgroup quota): the run's pace is bounded whatever the machine's
#: load, while the new host's checks and its rank's start-up grow with it.
STEPS = 1200
HELD_CORES = 0.1
TRAINING = ["--task", "digits", "--steps", str(STEPS), "--seed", "5", "--batch-size", "16",
            "--threads", "1", "--strategy", "diloco", "--set", "H=20"]
ELASTIC = ["--elastic", "--heartbeat-timeout", "4", "--rejoin-backoff", "1"]


def _entries(ssh: SshWorld, tmp_path: Path) -> list[dict[str, str]]:
    return [{"name": f"box{i}", "host": s.address, "workdir": str(tmp_path / f"box{i}")}
            for i, s in enumerate(ssh.servers)]


#: Run in a host's namespace: does rank 0's gate send its challenge (32 bytes) to a
#: connection from here, or close it unanswered? Prints True or False.
GATE_PROBE = """
import socket, sys
with socket.create_connection((sys.argv[1], 29500), timeout=10) as s:
    s.settimeout(10)
    try:
        print(len(s.recv(32)) > 0)
    except ConnectionResetError:
        print(False)
"""


def _gate_answers_from(netns: str, gate: str) -> bool:
    done = subprocess.run(["ip", "netns", "exec", netns, PYTHON, "-c", GATE_PROBE, gate],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() == "True"


def _words(entry: dict[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in entry.items()]


@pytest.mark.slow
def test_a_host_added_mid_run_joins_at_an_outer_sync_and_trains(
        netns_three_hosts: tuple[SshWorld, Namespaces], tmp_path: Path) -> None:
    ssh, ns = netns_three_hosts
    entries = _entries(ssh, tmp_path)
    inventory = ssh.inventory(tmp_path / "inv.yaml", entries[:2], iface="eth0",
                              rendezvous={"port": 29500, "timeout": 60})
    run_id = f"add-{uuid.uuid4().hex[:8]}"
    run_dir = tmp_path / "runs" / run_id
    proc = start_meshtrain(ssh, "launch", str(inventory), "--out", str(tmp_path / "runs"), "--run-id", run_id,
                           *ELASTIC, *TRAINING, cwd=tmp_path)
    try:
        rank_0 = rank_pid_in(run_id, tmp_path / "box0")
        seen = read_until(proc, [f"step 1/{STEPS}"], timeout=120)
        with held_back(rank_0, HELD_CORES, "add-host-rank0"):
            box2 = entries[2]
            # Before it is added, the third host's connections to rank 0's gate are closed unanswered.
            assert _gate_answers_from(ns.hosts[2], ssh.servers[0].address) is False
            # Already in the run: refused in one line, nothing asked of the launcher.
            again = {**entries[1], "name": "again"}
            twice = meshtrain(ssh, "hosts", "add", str(run_dir), *_words(again), cwd=tmp_path)
            assert twice.returncode == 2 and "is already in the run as 'box1'" in twice.stderr, twice.stderr
            added = meshtrain(ssh, "hosts", "add", str(run_dir), *_words(box2), cwd=tmp_path)
            assert added.returncode == 0, added.stderr
            assert "as rank 2" in added.stdout, added.stdout
            seen += read_until(proc, ["host box2 is rank 2", "new host box2 joined as rank 2"], timeout=120)
        rest, _ = proc.communicate(timeout=300)
        output = seen + rest
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    assert "all 3 ranks finished in" in output and "(box2 added as rank 2)" in output, output
    assert f"refused a rendezvous connection from {box2['host']}" in output, output  # the probe, by rank 0
    summary = json.loads((run_dir / "summary.json").read_text())
    elastic = summary["elastic"]
    assert elastic["added"] == [{"rank": 2, "host": "box2"}]
    joined = [e for e in elastic["events"] if e["joined"]]
    assert [e["joined"] for e in joined] == [[2]] and joined[0]["heal_bytes"] > 0
    assert elastic["final_members"] == [0, 1, 2] and elastic["lost_for_good"] == []
    # It came in at an outer sync (a multiple of H), and metrics.csv says who was in.
    assert joined[0]["step"] % 20 == 0, joined[0]
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    members = [r.split(",")[header.index("members")] for r in rows[2:]]  # after the step-0 row
    first = members.index("0 1 2")
    assert set(members[:first]) == {"0 1"} and set(members[first:]) == {"0 1 2"}, members
    assert first == joined[0]["step"], (first, joined[0])  # its first step (first + 1) is the one after
    assert [int(r.split(",")[header.index("step")]) for r in rows[1:]] == list(range(STEPS + 1))
    # Its rank trained and reported: its own figures (a slot with no report has none) and output.
    shares = summary["collective_share_per_node"]
    assert len(shares) == 3 and shares[2] is not None
    assert (run_dir / "ranks" / "box2-r2.log").is_file()
    # The inventory of record holds the third host; the launch is over.
    record = yaml.safe_load((run_dir / "launch" / "hosts.yaml").read_text())
    assert [h["name"] for h in record["hosts"]] == ["box0", "box1", "box2"]
    assert json.loads((run_dir / "launch" / "launcher.json").read_text())["running"] is False
    final, initial = summary["final_val_loss"], summary["initial"]["val_loss"]
    print(f"final validation loss {final:.4f} (initial {initial:.4f})")  # for the report
    assert final < 0.25 * initial, (final, initial)


def test_hosts_add_refuses_a_folder_that_is_not_a_running_elastic_launch(tmp_path: Path) -> None:
    runner = CliRunner()
    for run_dir, message in (
            (tmp_path / "nothing", "no such run directory"),
            (tmp_path, "not the run directory of a running `meshtrain launch --elastic`")):
        done = runner.invoke(app, ["hosts", "add", str(run_dir), "name=b", "host=10.255.0.2"])
        assert done.exit_code == 2, done.stdout + done.stderr
        assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    ended = tmp_path / "ended"
    (ended / "launch").mkdir(parents=True)
    (ended / "launch" / "launcher.json").write_text(json.dumps({"pid": 1, "running": False}))
    done = runner.invoke(app, ["hosts", "add", str(ended), "name=b", "host=10.255.0.2"])
    assert done.exit_code == 2 and "its launch has ended" in done.stderr, done.stderr


def test_hosts_add_refuses_a_host_already_in_the_run_in_one_line(tmp_path: Path) -> None:
    inventory = tmp_path / "hosts.yaml"  # never contacted: `hosts add` only reads and writes files
    inventory.write_text("defaults: {python: /usr/bin/python3, workdir: /tmp/mt}\n"
                         "hosts:\n  - {name: a, host: 10.255.0.1}\n  - {name: b, host: 10.255.0.2}\n")
    run_dir = tmp_path / "runs" / "r1"
    # This process plays the running launcher (its pid is alive).
    assert RunControl.claim(run_dir, "r1", load_inventory(inventory)) is not None
    runner = CliRunner()
    for words, message in ((["name=b", "host=10.255.0.3"], "duplicate name 'b'"),
                           (["name=c", "host=10.255.0.1"], "is already in the run as 'a'"),
                           (["name=c", "host=10.255.0.3", "port=0"], "bad port 0")):
        done = runner.invoke(app, ["hosts", "add", str(run_dir), *words])
        assert done.exit_code == 2, done.stdout + done.stderr
        assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert list((run_dir / "launch" / "requests").glob("*.yaml")) == []  # nothing asked of the launcher
    done = runner.invoke(app, ["hosts", "add", str(run_dir), "name=c", "host=10.255.0.3"])
    assert done.exit_code == 0 and "as rank 2" in done.stdout, done.stdout + done.stderr
    assert len(list((run_dir / "launch" / "requests").glob("*.yaml"))) == 1
