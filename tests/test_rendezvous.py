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

from meshtrain.comm.rendezvous import SECRET_FILE_ENV, new_secret


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
        secret_file = tmp_path / f"secret-{rank}"
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
    assert not (tmp_path / "secret-0").exists() and not (tmp_path / "secret-1").exists()


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
