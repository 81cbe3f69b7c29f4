"""Gate and tunnel with a real two-process gloo group on loopback.

Once the group has formed, nothing listens any more: the rendezvous port (rank 0's gate)
and rank 1's tunnel refuse connections, while the group itself keeps working (an
all-reduce and the orderly teardown both go through the already-open connections).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
from pathlib import Path

import torch
from ssh_fixtures import free_port

from meshtrain.comm.rendezvous import SECRET_FILE_ENV, SECRET_FOLDER_PREFIX, new_secret


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def _rank(rank: int, port: int, secret_file: str, report: str) -> None:
    import os

    import torch.distributed as dist

    from meshtrain.comm import rendezvous
    from meshtrain.comm.torch_dist import init_process_group, leave_in_order

    os.environ[SECRET_FILE_ENV] = secret_file
    tunnels: list[int] = []
    original = rendezvous.Tunnel.__init__

    def remember_port(self, *args, **kwargs):  # the tunnel's port is chosen by the OS
        original(self, *args, **kwargs)
        tunnels.append(self.port)

    rendezvous.Tunnel.__init__ = remember_port
    init_process_group(rank, 2, "127.0.0.1", port, torch.device("cpu"), timeout_s=30)
    listening = {"gate": not _refused(port)}
    if tunnels:
        listening["tunnel"] = not _refused(tunnels[0])
    dist.barrier()  # both ranks have probed before anyone leaves
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    leave_in_order(rank, 2, 30)
    Path(report).write_text(json.dumps({"listening": listening, "sum": value.item()}))


def test_nothing_listens_once_the_group_has_formed(tmp_path: Path) -> None:
    port = free_port()
    secret = new_secret()
    procs = []
    ctx = mp.get_context("spawn")
    for rank in range(2):
        folder = tmp_path / f"{SECRET_FOLDER_PREFIX}{rank}"
        folder.mkdir(mode=0o700)
        secret_file = folder / "secret"
        secret_file.write_text(secret)
        secret_file.chmod(0o600)
        procs.append(ctx.Process(target=_rank, args=(rank, port, str(secret_file),
                                                     str(tmp_path / f"report-{rank}.json"))))
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    reports = [json.loads((tmp_path / f"report-{r}.json").read_text()) for r in range(2)]
    assert reports[0] == {"listening": {"gate": False}, "sum": 3.0}
    assert reports[1] == {"listening": {"gate": False, "tunnel": False}, "sum": 3.0}
    assert not list(tmp_path.glob(f"{SECRET_FOLDER_PREFIX}*"))  # read, then removed with its folder


def test_a_gate_can_reopen_its_port_after_refusing_a_connection() -> None:
    """A refused connection is closed by the gate, leaving TIME_WAIT on the rendezvous
    port: the next launch must still get the port, while a port in use stays refused."""
    import pytest

    from meshtrain.comm.rendezvous import Gate

    port = free_port()
    gate = Gate("127.0.0.1", port, store_port=free_port(), secret=b"s" * 64)
    try:
        intruder = socket.create_connection(("127.0.0.1", port), timeout=5)
        intruder.settimeout(5)
        intruder.recv(32)  # the challenge
        intruder.sendall(b"x" * 64)  # a wrong answer: the gate closes first
        assert intruder.recv(32) == b""
        intruder.close()
        with pytest.raises(RuntimeError, match=f"rendezvous port {port} on 127.0.0.1 is in use"):
            Gate("127.0.0.1", port, store_port=free_port(), secret=b"s" * 64)
    finally:
        gate.close()
    Gate("127.0.0.1", port, store_port=free_port(), secret=b"s" * 64).close()  # TIME_WAIT: fine


def test_a_tunnel_serves_exactly_one_local_connection() -> None:
    """Rank 1's tunnel hands its authenticated store connection to one local connection,
    the rank's own store client, and stops listening: another local process, before or
    after it, is refused and cannot borrow the rank's admission to rank 0's store."""
    import subprocess
    import sys
    import threading

    from meshtrain.comm.rendezvous import Gate, Tunnel

    store = socket.create_server(("127.0.0.1", 0))  # stands in for rank 0's store: echoes

    def echo() -> None:
        conn, _ = store.accept()
        while data := conn.recv(1024):
            conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    secret, port = new_secret().encode(), free_port()
    gate = Gate("127.0.0.1", port, store.getsockname()[1], secret, admissions=2)
    tunnel = Tunnel("127.0.0.1", port, secret, timeout_s=10)
    try:
        if sys.platform.startswith("linux"):  # another local process is refused, first or not
            other = subprocess.run([sys.executable, "-c", (
                "import socket,sys; s=socket.create_connection(('127.0.0.1',int(sys.argv[1])),timeout=5); "
                "s.settimeout(5); print(repr(s.recv(4)))"), str(tunnel.port)],
                capture_output=True, text=True, timeout=60)
            assert other.stdout.strip() == "b''", other.stdout + other.stderr  # closed unserved
        first = socket.create_connection(("127.0.0.1", tunnel.port), timeout=5)
        first.sendall(b"ping")
        assert first.recv(4) == b"ping"
        assert _refused(tunnel.port)
        first.close()
    finally:
        gate.close()
        tunnel.close()
        store.close()


def test_the_gate_closes_strangers_before_any_handshake_and_keeps_slots_for_ranks(
        capfd) -> None:  # noqa: ANN001 - pytest's fixture
    """With the inventory's addresses the gate closes a connection from any other address
    as soon as it is accepted (no challenge is sent), so 200 half-open connections from a
    stranger (127.0.0.2, on Linux's loopback) hold no slot: a rank still gets through.
    A peer that never answers the challenge is dropped at the handshake deadline."""
    import sys
    import time

    import pytest

    from meshtrain.comm import rendezvous
    from meshtrain.comm.rendezvous import Gate, peer_addresses, rank_handshake

    if not sys.platform.startswith("linux"):
        pytest.skip("127.0.0.2 is a loopback address on Linux only")
    secret, port = new_secret().encode(), free_port()
    store = socket.create_server(("127.0.0.1", 0))
    gate = Gate("127.0.0.1", port, store.getsockname()[1], secret, admissions=1,
                peers=peer_addresses([["127.0.0.1"]]))
    strangers = []
    try:
        for _ in range(200):
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.settimeout(5)
            s.connect(("127.0.0.1", port))
            strangers.append(s)
        assert all(s.recv(32) == b"" for s in strangers)  # closed without a challenge
        # A silent inventory peer holds its address's slots only until the deadline.
        silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
        started = time.monotonic()
        while True:  # as the tunnel does: the address's slots are busy, so try again
            rank = socket.create_connection(("127.0.0.1", port), timeout=10)
            rank.settimeout(10)
            try:
                rank_handshake(rank, secret)
                break
            except ConnectionError:
                rank.close()
                time.sleep(0.1)
        waited = time.monotonic() - started
        assert waited < rendezvous.GATE_HANDSHAKE_TIMEOUT_S + 2, waited
        # The gate admits the rank to the store. Waiting for that before the store closes
        # keeps the gate's thread from finding the store gone after this test has ended (its
        # "could not admit" line then went to the next test's closed capture).
        store.settimeout(10)
        admitted, _ = store.accept()
        admitted.close()
        rank.close()
        for s in silent:
            s.close()
    finally:
        for s in strangers:
            s.close()
        gate.close()
        store.close()
    err = capfd.readouterr().err
    assert err.count("from 127.0.0.2") == 1, err  # a flood is one line
    assert "not an inventory host's address" in err


def test_a_rank_admitted_after_the_store_is_gone_is_closed_with_one_line(
        capfd, monkeypatch) -> None:  # noqa: ANN001 - pytest's fixtures
    """Rank 0's store can stop (rank 0 failed, or the run ended) while a rank is still in
    the handshake: the gate closes that rank's connection and says why in one line; its
    thread does not die with a stack trace."""
    import threading

    from meshtrain.comm.rendezvous import Gate, rank_handshake

    died: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    gone = socket.create_server(("127.0.0.1", 0))
    store_port = gone.getsockname()[1]
    gone.close()  # nothing listens there now
    secret, port = new_secret().encode(), free_port()
    gate = Gate("127.0.0.1", port, store_port, secret, admissions=1)
    try:
        rank = socket.create_connection(("127.0.0.1", port), timeout=10)
        rank.settimeout(10)
        rank_handshake(rank, secret)
        assert rank.recv(1) == b""  # closed by the gate, not piped to a store
        rank.close()
    finally:
        gate.close()
    assert not died
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "the rendezvous store is gone" in err, err


def test_sealed_listeners_drop_new_connections_and_keep_the_old_ones() -> None:
    """What a rank does to gloo's listener once the group has formed (Linux): a socket
    filter drops every new connection before it makes a socket; connections already
    made keep working."""
    import sys

    import pytest

    from meshtrain.comm.sealing import seal_listening_sockets

    if not sys.platform.startswith("linux"):
        pytest.skip("socket filters (SO_ATTACH_FILTER) are Linux's")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    accepted, _ = listener.accept()
    try:
        assert seal_listening_sockets([listener.fileno()]) == [f"127.0.0.1:{port}"]
        client.sendall(b"still here")
        assert accepted.recv(10) == b"still here"
        with pytest.raises(TimeoutError):  # the SYN is dropped: nothing answers
            socket.create_connection(("127.0.0.1", port), timeout=1)
    finally:
        for s in (client, accepted, listener):
            s.close()


def test_a_rank_that_died_inside_gloo_is_told_the_likely_cause() -> None:
    from meshtrain.comm.sealing import GLOO_HINT
    from meshtrain.launch.launcher import _with_likely_cause

    tail = ["terminate called after throwing an instance of 'gloo::IoException'",
            "  what():  [gloo/transport/tcp/pair.cc:...] accept: Too many open files"]
    assert _with_likely_cause("exited with status 134", tail) == f"exited with status 134 ({GLOO_HINT})"
    assert _with_likely_cause("exited with status 1", ["ValueError: bad"]) == "exited with status 1"
    assert "close them to non-inventory addresses: see docs/security.md" in GLOO_HINT
    assert (Path(__file__).parents[1] / "docs" / "security.md").is_file()


#: Rank 1's store client connects through its tunnel while rank 0's gate is not yet up.
LATE_GATE = """
import datetime, socket, sys, threading, time
import torch.distributed as dist
from meshtrain.comm import rendezvous
from meshtrain.comm.torch_dist import host_loopback_store
secret, gate_port = b"s" * 64, int(sys.argv[1])
def rank0_starts_late():
    time.sleep(1.5)
    store, port = host_loopback_store(30)
    rank0_starts_late.store = store  # kept alive
    rendezvous.Gate("127.0.0.1", gate_port, port, secret, admissions=1)
threading.Thread(target=rank0_starts_late, daemon=True).start()
tunnel = rendezvous.Tunnel("127.0.0.1", gate_port, secret, timeout_s=30)
client = dist.TCPStore("127.0.0.1", tunnel.port, is_master=False, timeout=datetime.timedelta(seconds=30))
client.set("k", "v")
print("joined", client.get("k").decode())
"""


def test_a_rank_that_starts_before_rank_0_joins_without_a_stack_trace() -> None:
    """The race behind "rank 1 printed ~35 lines of c10d TCPStore stack traces" (issue 18):
    rank 1's store client reached its tunnel before rank 0's gate listened; the tunnel
    closed the connection, and torch's client logged a C++ stack trace at every retry. The
    tunnel now holds the store client's connection and waits for the gate itself."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", LATE_GATE, str(free_port())], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "joined v", done.stdout + done.stderr
    for trace in ("Exception raised from", "frame #"):
        assert trace not in done.stderr, done.stderr


def test_a_launched_rank_raises_its_open_file_limit_to_the_hard_limit() -> None:
    """What every launched rank does at start: lift its soft limit on open files to the
    hard limit (gloo holds a descriptor per connection)."""
    import subprocess
    import sys

    import pytest

    if sys.platform == "win32":
        pytest.skip("no RLIMIT_NOFILE")
    script = ("import resource; from meshtrain.comm.sealing import raise_open_file_limit\n"
              "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
              "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
              "raise_open_file_limit()\n"
              "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "True", done.stdout + done.stderr  # in a launch: test_launch_security


def test_a_rank_whose_last_message_outlives_rank_0s_store_leaves_normally() -> None:
    """Rank 0 leaves as soon as it has counted every peer's "left"; the store's reply to the
    last peer's add can then be lost with the closed store (a launched fit's rank 1 once
    exited 1 there, after training had ended on both ranks). That peer's teardown is done:
    it leaves normally."""
    from datetime import timedelta

    import torch.distributed as dist

    from meshtrain.comm.torch_dist import LEFT_KEY, host_loopback_store, say_left

    server, port = host_loopback_store(10.0)
    peer = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    assert peer.add(LEFT_KEY, 0) == 0  # connected
    del server  # rank 0 exits: its store closes
    say_left(peer, 2)  # the last to leave; returns: no DistNetworkError


def test_the_last_peers_left_is_in_the_store_when_say_left_returns() -> None:
    """A launched rank's store traffic passes through its tunnel's relay thread, which dies
    with the rank's process: a message still in the relay when the rank exits is lost. A
    one-way "all left" lost that way left rank 0 waiting out LEAVE_GRACE_S (60 s at the end
    of launches on a busy machine). Here a relay holds every chunk toward the store for 1 s
    and is cut the moment say_left returns: the key must already be in the store."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from meshtrain.comm.torch_dist import ALL_LEFT_KEY, LEFT_KEY, host_loopback_store, say_left

    server, port = host_loopback_store(10.0)
    listener = socket.create_server(("127.0.0.1", 0))
    relay = {"delay": 0.0, "cut": threading.Event()}
    sockets: list[socket.socket] = []

    def forward(src: socket.socket, dst: socket.socket, held: bool) -> None:
        try:
            while chunk := src.recv(65536):
                if held:
                    time.sleep(relay["delay"])
                if relay["cut"].is_set():
                    return  # the rank's process has exited: what was in flight is gone
                dst.sendall(chunk)
        except OSError:
            pass

    def serve() -> None:
        conn, _ = listener.accept()
        store = socket.create_connection(("127.0.0.1", port))
        sockets.extend((conn, store))
        threading.Thread(target=forward, args=(conn, store, True), daemon=True).start()
        threading.Thread(target=forward, args=(store, conn, False), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    peer = dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=False,
                         timeout=timedelta(seconds=10))
    assert peer.add(LEFT_KEY, 0) == 0  # connected through the relay
    relay["delay"] = 1.0
    say_left(peer, 2)
    relay["cut"].set()
    for s in (*sockets, listener):
        s.close()
    assert server.check([ALL_LEFT_KEY])
