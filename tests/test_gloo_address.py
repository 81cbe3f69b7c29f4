"""Without an ``iface`` in the inventory, a launched rank's gloo listens on the host's
advertised address only (not on what the host name resolves to, often 127.0.0.1)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

import pytest

from meshtrain.comm.sealing import interface_with_address

PROBE = """
import os, subprocess, sys
from meshtrain.comm.sealing import bind_gloo_to_advertise
import torch.distributed as dist
print("iface", bind_gloo_to_advertise())
print("nccl", os.environ["NCCL_SOCKET_IFNAME"])
store = dist.TCPStore("127.0.0.1", 0, 1, True)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout.split("\\n")
mine = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
for line in mine:
    if f"pid={os.getpid()}," in line and f":{store.port} " not in line:
        print("gloo", line.split()[3])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="interfaces named as on Linux")
def test_the_loopback_address_is_on_lo() -> None:
    assert interface_with_address("127.0.0.1") == "lo"
    assert interface_with_address("192.0.2.1") is None  # TEST-NET-1: on no interface here


def test_gloo_listens_on_the_advertised_address_only() -> None:
    if shutil.which("ip") is None or shutil.which("ss") is None:
        pytest.skip("iproute2 (`ip`, `ss`) is not installed")
    if os.geteuid() != 0:
        pytest.skip("a network namespace needs root (CAP_NET_ADMIN)")
    ns = f"mt-{uuid.uuid4().hex[:6]}-gloo"
    address = "10.201.0.5"
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
    try:
        for args in (["link", "add", "eth0", "type", "veth", "peer", "name", "eth1"],
                     ["addr", "add", f"{address}/24", "dev", "eth0"],
                     ["link", "set", "eth0", "up"], ["link", "set", "eth1", "up"],
                     ["link", "set", "lo", "up"]):
            subprocess.run(["ip", "-n", ns, *args], check=True, capture_output=True)
        env = {**os.environ, "MESHTRAIN_ADVERTISE": address}
        env.pop("GLOO_SOCKET_IFNAME", None)
        env.pop("NCCL_SOCKET_IFNAME", None)
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", PROBE], env=env,
                             capture_output=True, text=True, timeout=120)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "iface eth0" in lines
    assert "nccl =eth0" in lines  # a CUDA rank's nccl is held to the same interface
    gloo = [line.split()[1] for line in lines if line.startswith("gloo ")]
    assert gloo and all(g.startswith(f"{address}:") for g in gloo), out.stdout


def test_the_launcher_tells_a_rank_without_iface_its_address() -> None:
    from meshtrain.hosts.inventory import parse_inventory
    from meshtrain.launch.launcher import rank_env

    inventory = parse_inventory({"hosts": [
        {"name": "a", "host": "10.0.0.1", "python": "/usr/bin/python3"},
        {"name": "b", "host": "10.0.0.2", "python": "/usr/bin/python3", "iface": "en0"},
        {"name": "c", "host": "10.0.0.3", "python": "/usr/bin/python3", "iface": "eth0",
         "env": {"NCCL_SOCKET_IFNAME": "ib,eth"}},
    ]}, "inline.yaml")
    plain, pinned, own_nccl = (rank_env(inventory, h, "r1") for h in inventory.hosts)
    assert plain["MESHTRAIN_ADVERTISE"] == "10.0.0.1" and "GLOO_SOCKET_IFNAME" not in plain
    assert "NCCL_SOCKET_IFNAME" not in plain  # the rank sets both once it knows the interface
    assert pinned["GLOO_SOCKET_IFNAME"] == "en0" and "MESHTRAIN_ADVERTISE" not in pinned
    assert pinned["NCCL_SOCKET_IFNAME"] == "=en0"  # exactly en0, not every name starting so
    assert (own_nccl["GLOO_SOCKET_IFNAME"], own_nccl["NCCL_SOCKET_IFNAME"]) == ("eth0", "ib,eth")
