"""A simulation listens on nothing but loopback (the processes runtime's rendezvous)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshtrain.comm.torch_dist import host_loopback_store


def listening_addresses(port: int) -> list[str]:
    """Local addresses of listening TCP sockets on ``port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_rendezvous_store_listens_on_loopback_only() -> None:
    store, port = host_loopback_store(timeout_s=10)
    try:
        assert listening_addresses(port) == ["0100007F"]  # 127.0.0.1, nothing else
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        del store
    assert listening_addresses(port) == []
