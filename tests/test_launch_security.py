"""The rendezvous of a launch admits only its own ranks.

Two hosts (network namespaces with sshd) run a launch; a third namespace, not in the
inventory, plays a rogue machine on the same LAN. Rank 0's store listens on 127.0.0.1
only; the rendezvous port on rank 0's address is a gate that demands this launch's secret
(an HMAC challenge), so the rogue can neither join, nor read or write the store, and is
reported. Once the group has formed the gate stops listening, so nothing is left to
knock on. A launch whose rendezvous port is taken fails with one line.
"""

from __future__ import annotations

import socket
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from ssh_fixtures import (
    PYTHON,
    Namespaces,
    SshWorld,
    make_namespaces,
    meshtrain,
    new_world,
    read_until,
    start_meshtrain,
    start_sshd,
)

from meshtrain.comm.rendezvous import gate_handshake, rank_handshake

pytestmark = pytest.mark.slow
PORT = 29517


def test_handshake_needs_the_same_secret_on_both_sides() -> None:
    import threading

    def attempt(gate_secret: bytes, rank_secret: bytes) -> tuple[object, object]:
        a, b = socket.socketpair()
        a.settimeout(5)
        b.settimeout(5)
        outcome: dict[str, object] = {}

        def gate() -> None:
            try:
                gate_handshake(a, gate_secret)
                outcome["gate"] = "admitted"
            except (PermissionError, ConnectionError) as exc:
                outcome["gate"] = exc
                a.close()

        t = threading.Thread(target=gate)
        t.start()
        try:
            rank_handshake(b, rank_secret)
            outcome["rank"] = "admitted"
        except (PermissionError, ConnectionError, OSError) as exc:
            outcome["rank"] = exc
        t.join()
        b.close()
        return outcome["gate"], outcome["rank"]

    assert attempt(b"s" * 64, b"s" * 64) == ("admitted", "admitted")
    gate, rank = attempt(b"s" * 64, b"t" * 64)
    assert isinstance(gate, PermissionError) and "does not know this launch's secret" in str(gate)
    assert not rank == "admitted"


@pytest.fixture(scope="module")
def lan(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SshWorld, Namespaces]]:
    """Hosts h0 and h1 with sshd (the inventory), h2 without (the rogue), and the launcher."""
    ns = make_namespaces(3)
    world = new_world(tmp_path_factory.mktemp("lan"))
    world.client_netns = ns.client
    try:
        for i, host_ns in enumerate(ns.hosts[:2]):
            server = start_sshd(world.folder / f"sshd-{i}", world.user_key.with_suffix(".pub"),
                                address=ns.addresses[host_ns], port=22, netns=host_ns)
            world.servers.append(server)
            world.trust(server)
        yield world, ns
    finally:
        for server in world.servers:
            server.stop()
        ns.delete()


ROGUE = textwrap.dedent("""
    import datetime, socket, sys, time
    import torch.distributed as dist
    address, port = sys.argv[1], int(sys.argv[2])
    # Knock until the gate listens (rank 0 is starting), as a machine scanning the LAN would.
    deadline = time.monotonic() + 120
    while True:
        try:
            s = socket.create_connection((address, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                print("never listened"); sys.exit(1)
            time.sleep(0.02)
    # 1. A handshake with a guessed secret (the gate closes a stranger before any challenge).
    try:
        s.recv(32)
        s.sendall(b"x" * 64)
        print("handshake:", "admitted" if s.recv(32) else "closed")
    except OSError as exc:
        print("handshake: closed", type(exc).__name__)
    # 2. torch's own store client, as if it were a rank, writing a 7 MB key.
    try:
        store = dist.TCPStore(address, port, is_master=False, timeout=datetime.timedelta(seconds=5))
        store.set("rogue", b"y" * 7_000_000)
        print("store: WRITTEN")
    except Exception as exc:
        print("store: refused", type(exc).__name__)
""")

#: Holds a port, as another program (or another launch still in its rendezvous) would.
HOLD_PORT = textwrap.dedent("""
    import socket, sys, time
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the test before may leave TIME_WAIT
    s.bind((sys.argv[1], int(sys.argv[2])))
    s.listen()
    print("holding", flush=True)
    time.sleep(300)
""")


def two_box_inventory(world: SshWorld, ns: Namespaces, tmp_path: Path) -> tuple[Path, str]:
    """The inventory of the two sshd hosts (rendezvous on PORT) and rank 0's address."""
    hosts = [{"name": f"box{i}", "host": s.address, "workdir": str(tmp_path / f"box{i}")}
             for i, s in enumerate(world.servers)]
    inv = world.inventory(tmp_path / "inv.yaml", hosts, iface="eth0",
                          rendezvous={"port": PORT, "timeout": 60})
    return inv, ns.addresses[ns.hosts[0]]


def test_rogue_machine_is_refused_and_nothing_listens_once_training(lan, tmp_path: Path) -> None:
    world, ns = lan
    inv, rank0 = two_box_inventory(world, ns, tmp_path)
    training = ["--task", "digits", "--strategy", "diloco", "--steps", "1500", "--set", "H=50",
                "--no-progress", "--threads", "1"]
    # The rogue waits on the LAN for the gate to open, then tries to join.
    rogue = subprocess.Popen(["ip", "netns", "exec", ns.hosts[2], PYTHON, "-c", ROGUE, rank0, str(PORT)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = start_meshtrain(world, "launch", str(inv), "--out", str(tmp_path / "runs"), "--run-id", "first",
                            *training, cwd=tmp_path)
    try:
        rogue_out, _ = rogue.communicate(timeout=150)
        assert "handshake: closed" in rogue_out, rogue_out
        assert "store: refused" in rogue_out, rogue_out
        # Training has started once rank 0 prints: the group has formed, nothing listens.
        seen = read_until(first, ["box0 r0 |"], timeout=120)
        listening = subprocess.run(["ip", "netns", "exec", ns.hosts[0], "ss", "-Htln"], capture_output=True,
                                   text=True, timeout=20).stdout
        assert f":{PORT} " not in listening, listening
        assert first.stdout is not None
        out = seen + first.stdout.read()  # not communicate(): it would skip what readline buffered
        first.wait(timeout=60)
    finally:
        for proc in (rogue, first):
            if proc.poll() is None:
                proc.kill()
    assert first.returncode == 0, out
    rogue_address = ns.addresses[ns.hosts[2]]
    assert f"refused a rendezvous connection from {rogue_address}" in out, out
    assert (tmp_path / "runs" / "first" / "summary.json").is_file()
    assert not (tmp_path / "box0" / "runs" / "rogue").exists()


def test_a_launch_on_a_port_in_use_fails_with_one_line(lan, tmp_path: Path) -> None:
    world, ns = lan
    inv, rank0 = two_box_inventory(world, ns, tmp_path)
    holder = subprocess.Popen(["ip", "netns", "exec", ns.hosts[0], PYTHON, "-c", HOLD_PORT, rank0, str(PORT)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        second = meshtrain(world, "launch", str(inv), "--out", str(tmp_path / "runs"), "--run-id", "second",
                           "--task", "digits", "--steps", "5", "--no-progress", cwd=tmp_path, timeout=180)
    finally:
        holder.kill()
        holder.wait()
    assert second.returncode != 0
    assert f"rendezvous port {PORT} on {rank0} is in use" in second.stdout + second.stderr
    assert "Traceback" not in second.stdout + second.stderr
