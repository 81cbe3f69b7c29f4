"""The fastest link between the hosts: list each host's addresses over SSH, time a few
megabytes to every address the others share a network with, and pick per host the address
(and its interface) the rendezvous and gloo should use.

On Macs the host name often resolves to Wi-Fi while a Thunderbolt bridge or Ethernet
between the same machines is many times faster. ``hosts bench`` (and so ``meshtrain up``)
runs :func:`choose_links` first and records the choice in the inventory: ``advertise``
(the rendezvous address and what gloo listens on), ``iface`` (GLOO_SOCKET_IFNAME) and
``link_bandwidth`` (what was measured, bytes/s).

Every byte a host sends back is hostile: its address list is read in bounded size and
count and parsed strictly (:func:`parse_addresses`), and a timing must be one exact line
within bounds (:func:`parse_timing`). The measurement's listener accepts only a
connection that first sends a random token, given to both ends on stdin (never on a
command line).
"""

from __future__ import annotations

import ipaddress
import re
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import paramiko

from meshtrain.errors import InputError
from meshtrain.hosts.inventory import Host, Inventory
from meshtrain.hosts.ssh import HostPath, Result, Shell, connect, run, sh, shell_line

#: What a host's address listing may print: a busy Mac prints a few KiB.
MAX_LISTING_BYTES = 64 * 1024
#: Addresses one host may report; more is refused (a host inventing thousands of links
#: would make the launcher measure for hours).
MAX_ADDRESSES = 64
MAX_IFACE_CHARS = 32
#: Bytes timed per address pair: a few MB, a second at 16 Mbit/s.
PROBE_BYTES = 2 * 1024 * 1024
TOKEN_BYTES = 32
#: Seconds one measurement may take end to end before the address counts as unreachable.
PROBE_TIMEOUT = 30.0
#: A timing below this is no measurement (a host's invention or a clock gone wrong).
MIN_PROBE_SECONDS = 1e-6

_IFACE = re.compile(r"^[A-Za-z0-9_.:-]+$")
# `ip -o addr show` (Linux): "2: eth0    inet 10.0.0.5/24 brd ... scope global eth0\ ..."
_IP_LINE = re.compile(r"^\d+:\s+(\S+)\s+(inet6?)\s+([0-9A-Fa-f.:]+)/(\d{1,3})(?:\s|$)")
# `ifconfig -a` (macOS): a header "en0: flags=..." then "\tinet 10.0.0.5 netmask 0xffffff00 ..."
_IFCONFIG_HEAD = re.compile(r"^([A-Za-z0-9_.:-]+): flags=")
_IFCONFIG_INET = re.compile(r"^\s+inet\s+([0-9.]+)\s+netmask\s+0x([0-9A-Fa-f]{8})(?:\s|$)")
_IFCONFIG_INET6 = re.compile(r"^\s+inet6\s+([0-9A-Fa-f:]+)(%\S+)?\s+prefixlen\s+(\d{1,3})(?:\s|$)")
_TIMING = re.compile(r"^received (\d{1,12}) ([0-9]+\.[0-9]+(?:e-?[0-9]+)?)$")


class LinkError(InputError):
    """A host's answer that cannot be a list of addresses or a timing."""


@dataclass(frozen=True)
class Address:
    """One address of one host's interface, with its network (prefix)."""

    iface: str
    interface: ipaddress.IPv4Interface | ipaddress.IPv6Interface

    @property
    def ip(self) -> str:
        return str(self.interface.ip)

    def shares_network_with(self, other: Address) -> bool:
        """Whether ``other`` is on this address's network (so one reaches the other directly)."""
        return (self.interface.version == other.interface.version
                and other.interface.ip in self.interface.network)


@dataclass(frozen=True)
class Measurement:
    """Bytes/s from host ``sender`` to host ``receiver``'s ``address``."""

    sender: str
    receiver: str
    address: Address
    bandwidth: float | None  # None: unreachable or no usable timing
    problem: str | None = None


@dataclass
class LinkChoice:
    """What :func:`choose_links` found for one host."""

    host: str
    address: Address
    bandwidth: float  # the slowest peer's rate to ``address`` (bytes/s)
    measurements: list[Measurement] = field(default_factory=list)


# --------------------------------------------------------------------------- addresses
def listing_command() -> str:
    """The remote command that lists a host's addresses (Linux ``ip``, else macOS ``ifconfig``)."""
    return sh(shell_line("ip", "-o", "addr", "show", Shell("2>/dev/null ||"), "ifconfig", "-a"))


def _usable(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    # IPv4 link-local (169.254/16) stays: a Mac's Thunderbolt bridge has only that. An IPv6
    # link-local address needs the peer's own interface as its scope, which this host's
    # listing cannot give: left out.
    return not (ip.is_loopback or ip.is_multicast or ip.is_unspecified or ip.is_reserved
                or (ip.version == 6 and ip.is_link_local)
                or (ip.version == 4 and ip == ipaddress.IPv4Address("255.255.255.255")))


def parse_addresses(text: str, source: str) -> list[Address]:
    """The usable addresses in ``ip -o addr show`` or ``ifconfig -a`` output from a host
    (``source`` names it); raises :class:`LinkError` for more than :data:`MAX_ADDRESSES`
    or an interface name that is not one. Lines that are neither format's address lines
    are skipped; loopback, multicast, unspecified and IPv6 link-local addresses dropped."""
    if len(text) > MAX_LISTING_BYTES:
        raise LinkError(f"{source}: address listing larger than {MAX_LISTING_BYTES} bytes")
    found: list[Address] = []
    current: str | None = None  # ifconfig's interface of the lines that follow
    for line in text.splitlines():
        iface: str | None = None
        spec: str | None = None
        if match := _IP_LINE.match(line):
            iface, spec = match[1].split("@")[0], f"{match[3]}/{match[4]}"
        elif match := _IFCONFIG_HEAD.match(line):
            current = match[1]
            continue
        elif (match := _IFCONFIG_INET.match(line)) and current is not None:
            iface, spec = current, f"{match[1]}/{bin(int(match[2], 16)).count('1')}"
        elif (match := _IFCONFIG_INET6.match(line)) and current is not None:
            iface, spec = current, f"{match[1]}/{match[3]}"
        if iface is None or spec is None:
            continue
        if len(iface) > MAX_IFACE_CHARS or not _IFACE.match(iface):
            raise LinkError(f"{source}: {iface[:40]!r} is not an interface name")
        try:
            interface = ipaddress.ip_interface(spec)
        except ValueError:
            raise LinkError(f"{source}: {spec[:60]!r} is not an address with a prefix") from None
        if not _usable(interface.ip):
            continue
        address = Address(iface, interface)
        if address not in found:
            found.append(address)
        if len(found) > MAX_ADDRESSES:
            raise LinkError(f"{source}: more than {MAX_ADDRESSES} addresses")
    return found


def shared_candidates(own: Sequence[Address], others: Sequence[Sequence[Address]]) -> list[Address]:
    """The addresses of ``own`` that every other host has an address on the same network with.

    An address another host also reports is never one: it cannot tell the two apart (two
    inventory entries for one machine, or two hosts behind one NAT), and traffic to it
    might never leave the sender."""
    claimed = {b.interface.ip for theirs in others for b in theirs}
    return [a for a in own if a.interface.ip not in claimed
            and all(any(a.shares_network_with(b) for b in theirs) for theirs in others)]


# --------------------------------------------------------------------------- timing
# Run by each host's python (``-c``): the launcher's own text, arguments after it. The
# receiver listens on ADDRESS:PORT, takes the first connection that sends the token, answers
# one byte, then times SIZE bytes from that moment; the sender retries its connection until
# the receiver listens.
RECEIVER = r"""
import socket, sys, time
address, port, size, wait = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
token = sys.stdin.buffer.read(32)
end = time.monotonic() + wait
server = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((address, port))
server.listen(4)
while True:
    server.settimeout(max(0.01, end - time.monotonic()))
    conn, _ = server.accept()
    conn.settimeout(max(0.01, end - time.monotonic()))
    got = b""
    while len(got) < len(token):
        chunk = conn.recv(len(token) - len(got))
        if not chunk:
            break
        got += chunk
    if got != token:
        conn.close()
        continue
    started = time.perf_counter()
    conn.sendall(b"g")
    count = 0
    while count < size:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        count += len(chunk)
    seconds = time.perf_counter() - started
    conn.sendall(b"d")
    conn.close()
    print(f"received {count} {seconds:.9f}")
    break
"""

SENDER = r"""
import socket, sys, time
address, port, size, wait = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
token = sys.stdin.buffer.read(32)
end = time.monotonic() + wait
while True:
    try:
        conn = socket.create_connection((address, port), timeout=1)
        break
    except OSError:
        if time.monotonic() > end:
            sys.exit("no listener at " + address)
        time.sleep(0.05)
conn.settimeout(max(0.01, end - time.monotonic()))
conn.sendall(token)
if conn.recv(1) != b"g":
    sys.exit("refused")
block = bytes(1 << 16)
left = size
while left > 0:
    conn.sendall(block[: min(left, len(block))])
    left -= len(block)
conn.recv(1)
conn.close()
"""


def parse_timing(text: str, size: int, wait: float, source: str) -> float:
    """Bytes/s from the receiver's one line ``received COUNT SECONDS``; raises
    :class:`LinkError` unless the line is exactly that, COUNT is ``size`` and SECONDS is
    from :data:`MIN_PROBE_SECONDS` to ``wait``."""
    lines = text.strip().splitlines()
    match = _TIMING.match(lines[0]) if len(lines) == 1 and len(lines[0]) < 100 else None
    if match is None:
        raise LinkError(f"{source}: not a timing ({text[:80]!r})")
    count, seconds = int(match[1]), float(match[2])
    if count != size:
        raise LinkError(f"{source}: received {count} bytes of {size}")
    if not MIN_PROBE_SECONDS <= seconds <= wait:
        raise LinkError(f"{source}: {seconds!r} s is not a time from {MIN_PROBE_SECONDS:g} to {wait:g} s")
    return size / seconds


def _measure(clients: dict[str, paramiko.SSHClient], sender: Host, receiver: Host, address: Address,
             port: int, size: int, wait: float) -> Measurement:
    token = secrets.token_bytes(TOKEN_BYTES)
    args = [address.ip, str(port), str(size), str(wait)]
    received: list[Result | BaseException] = []

    def receive() -> None:
        try:
            received.append(run(clients[receiver.name],
                                shell_line(HostPath(receiver.python), "-c", RECEIVER, *args),
                                timeout=wait + 10, stdin=token, max_output=4096))
        except BaseException as exc:  # noqa: BLE001 - reported as this pair's problem
            received.append(exc)

    listener = threading.Thread(target=receive, name="meshtrain-link-receiver", daemon=True)
    listener.start()
    try:
        sent = run(clients[sender.name], shell_line(HostPath(sender.python), "-c", SENDER, *args),
                   timeout=wait + 10, stdin=token, max_output=4096)
    except Exception as exc:  # noqa: BLE001 - an unreachable address is a result, not a failure
        sent = exc  # type: ignore[assignment]
    listener.join(wait + 15)
    source = f"{receiver.name} ({address.ip} on {address.iface})"
    answer = received[0] if received else TimeoutError("no answer")
    if isinstance(answer, BaseException) or isinstance(sent, BaseException):
        problem = answer if isinstance(answer, BaseException) else sent
        return Measurement(sender.name, receiver.name, address, None, f"{type(problem).__name__}: {problem}")
    if answer.status != 0 or sent.status != 0:
        why = (sent.stderr or answer.stderr).strip().splitlines()
        return Measurement(sender.name, receiver.name, address, None,
                           (why[-1] if why else f"exit {answer.status}/{sent.status}")[:200])
    try:
        rate = parse_timing(answer.stdout, size, wait, source)
        return Measurement(sender.name, receiver.name, address, rate)
    except LinkError as exc:
        return Measurement(sender.name, receiver.name, address, None, str(exc))


# --------------------------------------------------------------------------- choosing
def choose_links(inv: Inventory, *, accept_new_host_keys: bool = False, size: int = PROBE_BYTES,
                 wait: float = PROBE_TIMEOUT,
                 report: Callable[[Measurement], None] | None = None) -> list[LinkChoice]:
    """For every host with more than one address the others share a network with, time
    ``size`` bytes from every other host to each, one pair at a time (so no two
    measurements share a link), and choose the address whose slowest peer was fastest.

    Hosts with one shared address (nothing to choose) are not measured. Raises
    :class:`~meshtrain.hosts.ssh.SSHError` when a host cannot be reached over SSH and
    :class:`LinkError` for a host's hostile listing; an address that cannot be measured
    is left out of the choice (``report`` sees it with its problem).
    """
    clients: dict[str, paramiko.SSHClient] = {}
    try:
        listings: dict[str, list[Address]] = {}
        for host in inv.hosts:
            clients[host.name] = connect(host, accept_new_host_keys=accept_new_host_keys)
            answer = run(clients[host.name], listing_command(), timeout=30, max_output=MAX_LISTING_BYTES)
            listings[host.name] = parse_addresses(answer.stdout, f"host {host.name}: address listing")
        choices: list[LinkChoice] = []
        port = inv.rendezvous.port  # free until the launch that follows uses it
        for receiver in inv.hosts:
            peers = [h for h in inv.hosts if h.name != receiver.name]
            candidates = shared_candidates(listings[receiver.name], [listings[p.name] for p in peers])
            if len(candidates) < 2:
                continue
            best: LinkChoice | None = None
            done: list[Measurement] = []
            for address in candidates:
                rates: list[float] = []
                for sender in peers:
                    m = _measure(clients, sender, receiver, address, port, size, wait)
                    done.append(m)
                    if report is not None:
                        report(m)
                    if m.bandwidth is not None:
                        rates.append(m.bandwidth)
                if len(rates) == len(peers) and (best is None or min(rates) > best.bandwidth):
                    best = LinkChoice(receiver.name, address, min(rates))
            if best is not None:
                best.measurements = done
                choices.append(best)
        return choices
    finally:
        for client in clients.values():
            client.close()
