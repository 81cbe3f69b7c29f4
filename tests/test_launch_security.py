"""The rendezvous of a launch admits only its own ranks.

Two hosts (network namespaces with sshd) run a launch; a third namespace, not in the
inventory, plays a rogue machine on the same LAN. Rank 0's store listens on 127.0.0.1
only; the rendezvous port on rank 0's address is a gate that demands this launch's secret
(an HMAC challenge), so the rogue can neither join, nor read or write the store, and is
reported. A second launch on the same inventory and port fails with one line and never
joins the first one's group.
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
    import datetime, socket, sys
    import torch.distributed as dist
    address, port = sys.argv[1], int(sys.argv[2])
    # 1. A handshake with a guessed secret.
    s = socket.create_connection((address, port), timeout=5)
    s.recv(32)
    s.sendall(b"x" * 64)
    try:
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


def test_rogue_machine_and_second_launch_are_refused(lan, tmp_path: Path) -> None:
    world, ns = lan
    hosts = [{"name": f"box{i}", "host": s.address, "workdir": str(tmp_path / f"box{i}")}
             for i, s in enumerate(world.servers)]
    inv = world.inventory(tmp_path / "inv.yaml", hosts, iface="eth0",
                          rendezvous={"port": PORT, "timeout": 60})
    rank0 = ns.addresses[ns.hosts[0]]
    training = ["--task", "digits", "--strategy", "diloco", "--steps", "1500", "--set", "H=50",
                "--no-progress", "--threads", "1"]
    first = start_meshtrain(world, "launch", str(inv), "--out", str(tmp_path / "runs"), "--run-id", "first",
                            *training, cwd=tmp_path)
    try:
        # Training has started once rank 1 is past the rendezvous: its first progress line.
        read_until(first, ["box0 r0 |"], timeout=120)
        listening = subprocess.run(["ip", "netns", "exec", ns.hosts[0], "ss", "-Htln"], capture_output=True,
                                   text=True, timeout=20).stdout
        assert f"{rank0}:{PORT}" in listening  # the gate, on rank 0's address only
        assert f"0.0.0.0:{PORT}" not in listening and f"*:{PORT}" not in listening

        rogue = subprocess.run(["ip", "netns", "exec", ns.hosts[2], PYTHON, "-c", ROGUE, rank0, str(PORT)],
                               capture_output=True, text=True, timeout=60)
        assert "handshake: closed" in rogue.stdout, rogue.stdout + rogue.stderr
        assert "store: refused" in rogue.stdout, rogue.stdout + rogue.stderr

        second = meshtrain(world, "launch", str(inv), "--out", str(tmp_path / "runs2"), "--run-id", "second",
                           *training, cwd=tmp_path, timeout=180)
        assert second.returncode != 0
        assert f"rendezvous port {PORT} on {rank0} is in use" in second.stdout + second.stderr

        out, _ = first.communicate(timeout=400)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, out
    rogue_address = ns.addresses[ns.hosts[2]]
    assert f"refused a rendezvous connection from {rogue_address}" in out
    assert (tmp_path / "runs" / "first" / "summary.json").is_file()
    assert not (tmp_path / "box0" / "runs" / "rogue").exists()
