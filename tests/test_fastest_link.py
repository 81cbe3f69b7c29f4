"""The fastest link between the hosts (issue 47 item 4): each host's addresses, listed over
SSH and parsed as hostile text; a timed transfer to every address the hosts share; the
fastest recorded in the inventory for the rendezvous and gloo; a ``thunderbolt`` cluster."""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from ssh_fixtures import Namespaces, SshWorld, meshtrain
from typer.testing import CliRunner

from meshtrain.cli.main import app
from meshtrain.cluster import CLUSTERS, get_cluster
from meshtrain.hosts.inventory import InventoryError, load_inventory
from meshtrain.hosts.inventory_edit import set_links
from meshtrain.hosts.links import (
    MAX_ADDRESSES,
    MAX_LISTING_BYTES,
    Address,
    LinkError,
    listing_command,
    parse_addresses,
    parse_timing,
    shared_candidates,
)

LINUX = """\
1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
1: lo    inet6 ::1/128 scope host \\       valid_lft forever preferred_lft forever
2: eth0    inet 10.200.0.10/24 brd 10.200.0.255 scope global eth0\\       valid_lft forever
2: eth0    inet6 fe80::fc:ff:fe00:1/64 scope link \\       valid_lft forever preferred_lft forever
3: tb0    inet 169.254.7.2/16 brd 169.254.255.255 scope link tb0\\       valid_lft forever
3: tb0    inet6 fd00::2/64 scope global \\       valid_lft forever preferred_lft forever
4: mc0    inet 224.0.0.251/32 scope global mc0\\       valid_lft forever
"""

# macOS `ifconfig -a`, abridged: loopback, Wi-Fi, the Thunderbolt bridge.
MACOS = """\
lo0: flags=8049<UP,LOOPBACK,RUNNING,MULTICAST> mtu 16384
\tinet 127.0.0.1 netmask 0xff000000
\tinet6 ::1 prefixlen 128
\tinet6 fe80::1%lo0 prefixlen 64 scopeid 0x1
en0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\tether 3c:22:fb:00:00:01
\tinet6 fe80::1c:2b%en0 prefixlen 64 secured scopeid 0xb
\tinet 192.168.1.20 netmask 0xffffff00 broadcast 192.168.1.255
bridge0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\tinet 169.254.33.7 netmask 0xffff0000 broadcast 169.254.255.255
"""


def _pairs(addresses: list[Address]) -> list[tuple[str, str]]:
    return [(a.iface, str(a.interface)) for a in addresses]


def test_linux_and_macos_listings_give_the_usable_addresses() -> None:
    assert _pairs(parse_addresses(LINUX, "h")) == [
        ("eth0", "10.200.0.10/24"), ("tb0", "169.254.7.2/16"), ("tb0", "fd00::2/64")]
    assert _pairs(parse_addresses(MACOS, "h")) == [
        ("en0", "192.168.1.20/24"), ("bridge0", "169.254.33.7/16")]


@pytest.mark.parametrize("text, message", [
    ("2: eth0;rm    inet 10.0.0.1/24 scope global\n", "is not an interface name"),
    (f"2: {'e' * 40}    inet 10.0.0.1/24 scope global\n", "is not an interface name"),
    ("2: eth0    inet 10.0.0.300/24 scope global\n", "is not an address with a prefix"),
    ("2: eth0    inet 10.0.0.1/99 scope global\n", "is not an address with a prefix"),
    ("".join(f"2: eth0    inet 10.0.{i // 250}.{i % 250 + 1}/16 scope global\n"
             for i in range(MAX_ADDRESSES + 1)), f"more than {MAX_ADDRESSES} addresses"),
    ("x" * (MAX_LISTING_BYTES + 1), "larger than"),
])
def test_a_hostile_listing_is_refused_naming_the_host(text: str, message: str) -> None:
    with pytest.raises(LinkError, match=message) as caught:
        parse_addresses(text, "host box1: address listing")
    assert str(caught.value).startswith("host box1: address listing: ")


def test_lines_of_neither_format_are_ignored() -> None:
    noise = "Welcome!\n\tinet 10.0.0.9 netmask 0xffffff00\n2: eth0 inet6 zz::1/64\n"
    assert parse_addresses(noise, "h") == []  # an inet line under no interface header: skipped


def test_the_listing_command_is_built_quoted() -> None:
    assert listing_command() == "/bin/sh -c 'ip -o addr show 2>/dev/null || ifconfig -a'"


def test_only_addresses_every_peer_shares_a_network_with_are_candidates() -> None:
    own = parse_addresses(LINUX, "a")
    peer = [Address("eth0", ipaddress.ip_interface("10.200.0.11/24")),
            Address("tb0", ipaddress.ip_interface("169.254.9.9/16"))]
    assert [a.ip for a in shared_candidates(own, [peer])] == ["10.200.0.10", "169.254.7.2"]
    assert [a.ip for a in shared_candidates(own, [peer, peer[:1]])] == ["10.200.0.10"]



def test_one_machine_listed_twice_has_no_link_to_choose() -> None:
    own = parse_addresses(LINUX, "a")
    assert shared_candidates(own, [own]) == []  # traffic to its own address never leaves it


@pytest.mark.parametrize("text, message", [
    ("received 100 0.5\n", None),
    ("received 99 0.5\n", "received 99 bytes of 100"),
    ("received 100 0.000000000\n", "is not a time"),
    ("received 100 99.0\n", "is not a time"),
    ("received 100 0.5\nreceived 100 0.5\n", "not a timing"),
    ("received 100 nan\n", "not a timing"),
    ("received 100 1e9\n", "not a timing"),
])
def test_a_timing_is_one_exact_line_within_bounds(text: str, message: str | None) -> None:
    if message is None:
        assert parse_timing(text, 100, 30.0, "h") == pytest.approx(200.0)
    else:
        with pytest.raises(LinkError, match=message):
            parse_timing(text, 100, 30.0, "h")


def test_the_choice_is_recorded_in_the_inventory(tmp_path: Path) -> None:
    path = tmp_path / "lab.yaml"
    path.write_text("defaults: {python: /usr/bin/python3, iface: eth0}\n"
                    "hosts:\n  - {name: a, host: 10.0.0.1}\n  - {name: b, host: 10.0.0.2}\n")
    path.chmod(0o640)
    assert set_links(path, {"b": ("169.254.7.2", "bridge0", 123456789.0)})
    b = load_inventory(path).hosts[1]
    assert (b.advertise, b.iface, b.link_bandwidth) == ("169.254.7.2", "bridge0", 1.235e8)
    assert load_inventory(path).hosts[0].iface == "eth0"  # the other host keeps the defaults'
    assert path.stat().st_mode & 0o777 == 0o640
    assert not set_links(path, {"b": ("169.254.7.2", "bridge0", 123456789.0)})  # nothing new


def test_a_bad_link_bandwidth_is_one_line_naming_host_and_key(tmp_path: Path) -> None:
    path = tmp_path / "lab.yaml"
    path.write_text("defaults: {python: /usr/bin/python3}\n"
                    "hosts:\n  - {name: a, host: 10.0.0.1, link_bandwidth: -5}\n")
    with pytest.raises(InventoryError, match=r"host 'a': key 'link_bandwidth': expected bytes per second"):
        load_inventory(path)


def test_clusters_lists_thunderbolt() -> None:
    tb = CLUSTERS["thunderbolt"]
    assert not tb.shared_medium and CLUSTERS["10gbe"].bandwidth <= tb.bandwidth < 2.5e9
    out = CliRunner().invoke(app, ["clusters"])
    assert out.exit_code == 0 and "thunderbolt" in out.output


# --------------------------------------------------------------------------- namespace hosts
SLOW_MBIT, FAST_MBIT = 16, 160
SECOND_SUBNET = "10.200.1"


def _tc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tc", *args], capture_output=True, text=True, timeout=20)


@pytest.fixture(scope="module")
def two_links(netns_hosts: tuple[SshWorld, Namespaces]) -> Iterator[tuple[SshWorld, Namespaces]]:
    """The session's two namespace hosts joined a second time, by a direct veth pair ``tb0``
    on 10.200.1.0/24; eth0 (the bridge SSH uses) limited to SLOW_MBIT, tb0 to FAST_MBIT,
    both ways. All of it is removed afterwards."""
    if shutil.which("tc") is None:
        pytest.skip("tc (iproute2) is not installed")
    world, ns = netns_hosts
    first, second = ns.hosts
    shaped: list[tuple[str, str]] = []
    subprocess.run(["ip", "-n", first, "link", "add", "tb0", "type", "veth", "peer", "name", "tb0",
                    "netns", second], check=True, capture_output=True, timeout=20)
    try:
        for i, host in enumerate(ns.hosts):
            subprocess.run(["ip", "-n", host, "addr", "add", f"{SECOND_SUBNET}.{10 + i}/24", "dev", "tb0"],
                           check=True, capture_output=True, timeout=20)
            subprocess.run(["ip", "-n", host, "link", "set", "tb0", "up"], check=True, capture_output=True,
                           timeout=20)
            for dev, mbit, burst in (("eth0", SLOW_MBIT, "32kbit"), ("tb0", FAST_MBIT, "256kbit")):
                done = _tc("-n", host, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                           "burst", burst, "latency", "50ms")
                if done.returncode != 0:
                    pytest.skip(f"cannot rate-limit a namespace link with tc tbf: {done.stderr.strip()}")
                shaped.append((host, dev))
        yield world, ns
    finally:
        for host, dev in shaped:
            _tc("-n", host, "qdisc", "del", "dev", dev, "root")
        subprocess.run(["ip", "-n", first, "link", "del", "tb0"], capture_output=True, timeout=20)


@pytest.mark.slow
def test_bench_chooses_the_faster_of_two_links_and_records_it(two_links: tuple[SshWorld, Namespaces],
                                                               tmp_path: Path) -> None:
    world, ns = two_links
    hosts = [{"name": f"box{i}", "host": s.address, "workdir": str(tmp_path / f"box{i}")}
             for i, s in enumerate(world.servers)]
    inv = world.inventory(tmp_path / "lab.yaml", hosts, rendezvous={"port": 29520, "timeout": 60})
    result = meshtrain(world, "hosts", "bench", str(inv), "--min-size", "64KB", "--max-size", "512KB",
                       "--points", "3", "--repeats", "2", cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    print(result.stdout)  # the measured rates, for the record (pytest -s)
    chosen = load_inventory(inv).hosts
    assert [(h.advertise, h.iface) for h in chosen] == [(f"{SECOND_SUBNET}.{10 + i}", "tb0")
                                                      for i in range(2)]
    assert [h.hostname for h in chosen] == [s.address for s in world.servers]  # SSH as before
    for host in chosen:
        # The fast link's measured rate: below its shaped rate, above the slow link's.
        assert host.link_bandwidth is not None
        assert SLOW_MBIT * 1e6 / 8 < host.link_bandwidth <= FAST_MBIT * 1e6 / 8 * 1.1, host
    assert result.stdout.count("fastest link to ") == 2
    # The all-reduces that follow ran over the chosen link (gloo on tb0), not the slow one.
    assert get_cluster(str(tmp_path / "clusters" / "lab.yaml")).bandwidth > 2 * SLOW_MBIT * 1e6 / 8
    raw = yaml.safe_load(inv.read_text())
    assert all("link_bandwidth" in h for h in raw["hosts"])


COMMENTED = """\
# The lab: two minis on the desk, one in the rack.   (a comment the user wrote)
defaults:
  python: /usr/bin/python3   # the system python
  iface: eth0

hosts:
  # rank 0: the one with the monitor
  - name: a          # desk, left
    host: 10.0.0.1
    # advertise is filled in by hosts bench
    advertise: 10.0.0.1   # the wired one, for now
    link_bandwidth: 1.0e6 # old measurement

  - name: b
    host: 10.0.0.2   # desk, right
    env:
      OMP_NUM_THREADS: "2"   # a nested mapping after name's line
  - {name: c, host: 10.0.0.3}   # the rack
# trailing words
"""


def test_recording_the_links_keeps_the_users_comments_and_layout(tmp_path: Path) -> None:
    """`hosts bench` and `meshtrain up` wrote the inventory again from its parsed form: every
    comment, blank line and the flow-style host were lost. Only the keys written change now."""
    path = tmp_path / "lab.yaml"
    path.write_text(COMMENTED)
    path.chmod(0o640)
    links = {"a": ("169.254.7.1", "bridge0", 2e9), "b": ("169.254.7.2", "bridge0", 123456789.0),
             "c": ("fe80::3%bridge0", "bridge0", 5e8)}
    assert set_links(path, links)
    text = path.read_text()
    for line in COMMENTED.splitlines():
        if "advertise: 10.0.0.1" in line or "link_bandwidth: 1.0e6" in line or "{name" in line:
            continue  # the two values replaced and the flow-style host: checked below
        assert line in text.splitlines(), line
    assert "  - {name: c, host: 10.0.0.3, " in text and text.count("}   # the rack\n") == 1
    assert "advertise: 169.254.7.1   # the wired one, for now" in text
    assert "link_bandwidth: 2000000000.0 # old measurement" in text
    hosts = {h.name: h for h in load_inventory(path).hosts}
    for name, (address, iface, bandwidth) in links.items():
        assert (hosts[name].advertise, hosts[name].iface) == (address, iface)
        assert hosts[name].link_bandwidth == float(f"{bandwidth:.4g}")
    assert hosts["b"].env == {"OMP_NUM_THREADS": "2"}
    assert path.stat().st_mode & 0o777 == 0o640
    assert not set_links(path, links)  # nothing new: the file is left as it is
    assert path.read_text() == text
