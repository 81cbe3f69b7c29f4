"""`meshtrain hosts discover`: real mDNS announcements on a bridged LAN of network namespaces.

Three host namespaces advertise ``_ssh._tcp.local.`` with zeroconf, each with a real sshd:
one accepts the test key, one refuses it, one has a host key that known_hosts lacks. A
fourth runs sshd without advertising: discovery must never contact it. The command runs
in the client namespace, as a user on that LAN would.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from ssh_fixtures import (
    PYTHON,
    Namespaces,
    SshWorld,
    _wait_reachable,
    generate_key,
    make_namespaces,
    meshtrain,
    new_world,
    rogue_announcing,
    start_advertising,
    start_sshd,
)
from typer.testing import CliRunner

from meshtrain.cli.main import app
from meshtrain.hosts.discovery import Found, host_name, inventory_dict, inventory_text
from meshtrain.hosts.inventory import load_inventory, parse_inventory

pytest.importorskip("zeroconf", reason="pip install 'meshtrain[discover]' (the test extra includes it)")

# (advertised name, mDNS host name) for hosts 0-2; host 3 does not advertise.
ADVERTISED = [("Studio One", "studio-1.local."), ("Refusing Box", "refusing.local."),
              ("New Box", "newbox.local.")]


@dataclass
class Lan:
    world: SshWorld
    ns: Namespaces
    address: list[str]  # of hosts 0-3

    def log_sizes(self) -> list[int]:
        return [len(s.log.read_bytes()) for s in self.world.servers]

    def connected_since(self, sizes: list[int], i: int) -> bool:
        """Whether host i's sshd saw any connection since ``sizes`` (from :meth:`log_sizes`)."""
        return b"Connection from" in self.world.servers[i].log.read_bytes()[sizes[i]:]


@pytest.fixture(scope="module")
def lan(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lan]:
    ns = make_namespaces(4)
    world = new_world(tmp_path_factory.mktemp("discover"))
    world.client_netns = ns.client
    other_key = generate_key(world.folder / "someone_else")
    advertisers: list[subprocess.Popen[str]] = []
    try:
        for i, host_ns in enumerate(ns.hosts):
            authorized = other_key if i == 1 else world.user_key
            server = start_sshd(world.folder / f"sshd-{i}", authorized.with_suffix(".pub"),
                                address=ns.addresses[host_ns], port=22, netns=host_ns)
            world.servers.append(server)
            if i != 2:  # host 2's key stays unknown
                world.trust(server)
        _wait_reachable(world, ns)
        for i, (service, server) in enumerate(ADVERTISED):
            advertisers.append(start_advertising(ns.hosts[i], service, server, ns.addresses[ns.hosts[i]]))
        yield Lan(world, ns, [ns.addresses[h] for h in ns.hosts])
    finally:
        for proc in advertisers:
            proc.kill()
            proc.wait(timeout=10)
        for server in world.servers:
            server.stop()
        ns.delete()


def discover(lan: Lan, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    w = lan.world
    return meshtrain(w, "hosts", "discover", "--timeout", "2", "--user", "root", "--identity-file",
                     str(w.user_key), "--known-hosts", str(w.known_hosts), *args, cwd=cwd, timeout=60)


def test_lists_advertised_hosts_and_writes_an_inventory_without_connecting(lan: Lan, tmp_path: Path) -> None:
    target = tmp_path / "hosts" / "mine.yaml"
    before = lan.log_sizes()
    result = discover(lan, "--write", str(target), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    for service, server in ADVERTISED:
        assert service in result.stdout and server.rstrip(".") in result.stdout
    for address in lan.address[:3]:
        assert address in result.stdout
    assert lan.address[3] not in result.stdout  # sshd there, but not advertised
    assert "not checked" in result.stdout

    inv = load_inventory(target)  # the launcher's own parser reads it
    assert [(h.name, h.hostname, h.advertise, h.port) for h in inv.hosts] == [
        ("newbox", lan.address[2], lan.address[2], 22),
        ("refusing", lan.address[1], lan.address[1], 22),
        ("studio-1", lan.address[0], lan.address[0], 22),
    ]
    assert {h.user for h in inv.hosts} == {"root"} and inv.hosts[0].python == PYTHON
    assert inv.hosts[0].identity_file == str(lan.world.user_key)
    # Without --check-keys nothing is connected to.
    assert not any(lan.connected_since(before, i) for i in range(4))
    assert not list(target.parent.glob(".*tmp"))  # no temporary file left behind


def test_a_narrow_terminal_shows_every_machine_whole(lan: Lan, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A Mac's advertised name and its addresses (IPv6 ones run to 30 characters) make the
    table wider than a small terminal, where rich cut them to "…": each machine is then its
    name on a line and its advertised name, addresses, port and key below it."""
    from meshtrain.cli.console import wide_console

    monkeypatch.setattr(wide_console, "_width", 40)
    result = discover(lan, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "…" not in result.stdout
    lines = result.stdout.splitlines()
    text = " ".join(result.stdout.split())
    for name, (service, server) in zip(("studio-1", "refusing", "newbox"), ADVERTISED, strict=True):
        assert name in lines, name
        assert service in text and server.rstrip(".") in text, (service, text)
    for address in lan.address[:3]:
        assert f"addresses {address} port 22 key not checked" in text, (address, text)


def test_check_keys_reports_each_host_and_writes_the_accepted_ones(lan: Lan, tmp_path: Path) -> None:
    known_before, before = lan.world.known_hosts.read_text(), lan.log_sizes()
    target = tmp_path / "mine.yaml"
    result = discover(lan, "--check-keys", "--write", str(target), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines()
            if line.count("│") > 3 and line.split("│")[1].strip()}
    assert "accepted" in rows["studio-1"]
    assert "refused" in rows["refusing"]
    assert "host-key-unknown" in rows["newbox"]
    assert "authentication refused for user 'root'" in result.stderr
    assert "unknown host key" in result.stderr
    assert lan.world.known_hosts.read_text() == known_before  # an unknown key is never recorded
    assert not lan.connected_since(before, 3)  # never a host that was not discovered
    assert all(lan.connected_since(before, i) for i in range(3))
    text = target.read_text()
    assert "key accepted" in text and "key refused" in text and "key host-key-unknown" in text
    # The host that lets us in comes first: rank 0.
    assert [h.name for h in load_inventory(target).hosts] == ["studio-1", "newbox", "refusing"]

    # Only the machines that accept the key, then check them as a launch would.
    result = discover(lan, "--check-keys", "--accepted-only", "--force", "--write", str(target),
                      cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    inv = load_inventory(target)
    assert [h.hostname for h in inv.hosts] == [lan.address[0]]
    check = meshtrain(lan.world, "hosts", "check", str(target), cwd=tmp_path, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "all 1 hosts ready" in check.stdout


def test_iface_and_network_filters(lan: Lan, tmp_path: Path) -> None:
    result = discover(lan, "--iface", "eth0", "--network", f"{lan.address[0]}/32", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "studio-1" in result.stdout and "(1 found" in result.stdout
    assert lan.address[1] not in result.stdout and lan.address[2] not in result.stdout


#: Runs in a host namespace: announces ``_ssh._tcp`` for the name in argv[1] with raw mDNS
#: answers (as any program on the LAN can; zeroconf itself refuses to register such a name),
#: every 0.2 s until killed.
CRAFTED = """
import socket, sys, time
from zeroconf import DNSAddress, DNSOutgoing, DNSPointer, DNSService, DNSText, const
name, address = sys.argv[1], sys.argv[2]
full = f"{name}._ssh._tcp.local."
out = DNSOutgoing(const._FLAGS_QR_RESPONSE | const._FLAGS_AA)
unique = const._CLASS_IN | const._CLASS_UNIQUE
out.add_answer_at_time(DNSPointer("_ssh._tcp.local.", const._TYPE_PTR, const._CLASS_IN, 120, full), 0)
out.add_answer_at_time(DNSService(full, const._TYPE_SRV, unique, 120, 0, 0, 22, "evil.local."), 0)
out.add_answer_at_time(DNSText(full, const._TYPE_TXT, unique, 120, b"\\x00"), 0)
out.add_answer_at_time(DNSAddress("evil.local.", const._TYPE_A, unique, 120, socket.inet_aton(address)), 0)
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(address))
print("sending", flush=True)
while True:
    for packet in out.packets():
        sock.sendto(packet, ("224.0.0.251", 5353))
    time.sleep(0.2)
"""


@pytest.mark.parametrize("name", ["E\n  - {name: inj, host: 10.200.0.99}\x1b[2J[red]x[/red]",
                                  "Plain [red]x[/red] [link=http://example.com]y[/link]"])
def test_a_strangers_announcement_is_shown_as_text_or_ignored(lan: Lan, tmp_path: Path, name: str) -> None:
    """Anyone on the LAN may announce any name. One that zeroconf refuses (control characters:
    a newline, then an inventory entry, an escape sequence) once raised from `hosts discover`;
    it is ignored. One it accepts, with rich markup, is listed as text, and the inventory
    written from it holds exactly the machine that announced it."""
    announce = [PYTHON, "-c", CRAFTED, name, lan.address[3]]
    proc = subprocess.Popen(["ip", "netns", "exec", lan.ns.hosts[3], *announce], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "sending"
        target = tmp_path / "mine.yaml"
        result = discover(lan, "--network", f"{lan.address[3]}/32", "--write", str(target), cwd=tmp_path)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    output = result.stdout + result.stderr
    assert "Traceback" not in output and "\x1b" not in output and "inj" not in output, output
    if "\n" in name:  # refused by zeroconf: as if never announced
        assert result.returncode == 1 and "nothing found, nothing written" in output, output
        assert not target.exists()
        return
    assert result.returncode == 0, output
    assert "Plain [red]x[/red] [link=http://example.com]y[/link]" in output, output
    inv = load_inventory(target)
    assert [(h.name, h.hostname) for h in inv.hosts] == [("evil", lan.address[3])], target.read_text()


# ---------------------------------------------------------------- bad input: one line, exit 2
runner = CliRunner()


def _one_error_line(result: object) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]  # type: ignore[attr-defined]
    assert len(lines) == 1, result.output  # type: ignore[attr-defined]
    return lines[0]


def test_without_zeroconf_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zeroconf", None)  # what an environment without it sees
    result = runner.invoke(app, ["hosts", "discover"])
    assert result.exit_code == 2
    assert "pip install 'meshtrain[discover]'" in _one_error_line(result)


def test_existing_file_is_refused_before_browsing(tmp_path: Path) -> None:
    target = tmp_path / "mine.yaml"
    target.write_text("keep me\n")
    result = runner.invoke(app, ["hosts", "discover", "--write", str(target)])
    assert result.exit_code == 2
    assert f"--write {target}: the file exists; pass --force" in _one_error_line(result)
    assert target.read_text() == "keep me\n"


@pytest.mark.parametrize(("args", "message"), [
    (["--iface", "nosuch0"], "--iface nosuch0: no such interface"),
    (["--network", "10.0.0.0/33"], "--network 10.0.0.0/33: expected an address range"),
    (["--accepted-only"], "--accepted-only needs --check-keys"),
    (["--python", "python3"], "--python python3: expected an absolute path"),
    (["--timeout", "0"], "--timeout: expected seconds"),
])
def test_bad_flags(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["hosts", "discover", *args])
    assert result.exit_code == 2
    assert message in _one_error_line(result)


def test_inventory_names_ports_and_round_trip(tmp_path: Path) -> None:
    found = [Found("Alice’s MacBook Pro", "Alices-MacBook-Pro.local", ("192.168.1.5", "fe80::1%en0"), 22),
             Found("box", "box.local", ("192.168.1.6",), 2222),
             Found("box", "box.local", ("192.168.1.7",), 22)]
    assert host_name(found[0]) == "Alices-MacBook-Pro"
    raw = inventory_dict(found, user="alice", python="/opt/homebrew/bin/python3")
    text = inventory_text(raw, found, None, tmp_path / "x.yaml")
    inv = parse_inventory(yaml.safe_load(text), tmp_path / "x.yaml")
    assert [(h.name, h.hostname, h.port, h.user) for h in inv.hosts] == [
        ("Alices-MacBook-Pro", "192.168.1.5", 22, "alice"),
        ("box", "192.168.1.6", 2222, "alice"),
        ("box-2", "192.168.1.7", 22, "alice"),
    ]
    assert "# Alice’s MacBook Pro (Alices-MacBook-Pro.local, 192.168.1.5, fe80::1%en0)" in text


# ---------------------------------------------------------------- a rogue on the LAN (issue 44 item 4)
@contextmanager
def rogue(lan: Lan, mode: str, count: int, addresses: list[str]) -> Iterator[None]:
    """Host 3 (its sshd never advertised) sends ``mode``'s answers while inside."""
    with rogue_announcing(lan.ns.hosts[3], mode, count, addresses, lan.address[3]):
        yield


def test_a_rogue_claiming_a_hosts_name_is_a_conflict_never_written(lan: Lan, tmp_path: Path) -> None:
    """A rogue announcing studio-1.local at its own address replaced the honest one in the
    written inventory, without a word (with `up --yes` the rogue became rank 0)."""
    target = tmp_path / "mine.yaml"
    with rogue(lan, "claim", 1, [lan.address[3]]):
        result = discover(lan, "--write", str(target), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    warning = " ".join(result.stderr.split())
    addresses = ", ".join(sorted([lan.address[0], lan.address[3]]))
    assert f"warning: conflict: studio-1 was announced with 2 addresses ({addresses})" in warning, warning
    hosts = {h.name: h.hostname for h in load_inventory(target).hosts}
    assert hosts == {"newbox": lan.address[2], "refusing": lan.address[1]}, target.read_text()


def test_a_name_already_in_the_inventory_announcing_a_new_address_is_not_replaced(lan: Lan,
                                                                                  tmp_path: Path) -> None:
    target = tmp_path / "mine.yaml"
    target.write_text("defaults: {user: root, python: /usr/bin/python3}\nhosts:\n"
                      "  - {name: studio-1, host: 10.200.0.99}\n")
    result = discover(lan, "--write", str(target), "--force", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (f"warning: conflict: studio-1 is at 10.200.0.99 in the inventory, but now announced at "
            f"{lan.address[0]}; left out") in " ".join(result.stderr.split())
    assert "studio-1" not in {h.name for h in load_inventory(target).hosts}


def test_names_that_never_resolve_cannot_stretch_the_timeout(lan: Lan, tmp_path: Path) -> None:
    """200 announced names that never answered made `--timeout 5` take 308 s (1.5 s each,
    one after another) while it printed "found in 5 s"."""
    with rogue(lan, "silent", 100, [lan.address[3]]):
        started = time.monotonic()
        result = discover(lan, cwd=tmp_path)
        took = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    assert took < 2 + 20, took  # --timeout 2, and the command's own start under load
    assert "100 announced names did not answer within 2 s (left out)" in " ".join(result.stderr.split())
    assert "(3 found in 2 s)" in result.stdout


def test_a_flood_of_hosts_is_capped_and_unusable_addresses_are_dropped(lan: Lan, tmp_path: Path) -> None:
    """3,000 announced hosts were written; 0.0.0.0, broadcast, multicast and loopback too."""
    cap = 128  # meshtrain.hosts.discovery.MAX_HOSTS
    target = tmp_path / "mine.yaml"
    unusable = ["0.0.0.0", "255.255.255.255", "224.0.0.5", "127.0.0.1"]
    with rogue(lan, "many", cap + 30, [lan.address[3], *unusable]):
        result = discover(lan, "--write", str(target), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    warning = " ".join(result.stderr.split())
    assert f"more than {cap} machines announced SSH: only the first {cap} heard" in warning, warning
    assert "with no usable name or address (0.0.0.0, loopback, multicast, broadcast): left out" in warning
    addresses = {h.hostname for h in load_inventory(target).hosts}
    assert len(load_inventory(target).hosts) <= cap
    assert not addresses & set(unusable), addresses
    from meshtrain.hosts.discovery import MAX_HOSTS
    assert cap == MAX_HOSTS
