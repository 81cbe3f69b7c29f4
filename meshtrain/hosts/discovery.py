"""Find machines on the LAN that offer SSH, the way Macs already announce it (Bonjour).

A Mac with Remote Login on (and any host running avahi's ssh service) advertises
``_ssh._tcp.local.`` over multicast DNS. :func:`browse` listens for those announcements
for a few seconds, :func:`check_keys` (only when asked) tries a public-key login on each
one found, and :func:`inventory_text` turns them into a starter inventory that
:mod:`meshtrain.hosts.inventory` reads. Browsing needs the optional ``zeroconf`` package
(``pip install 'meshtrain[discover]'``); nothing else here connects anywhere.

Anyone on the LAN may announce anything, so what is heard is checked before it is used:
the whole discovery, resolution included, ends by its deadline (``--timeout``); at most
:data:`MAX_HOSTS` machines are considered; addresses no machine can be reached at (0.0.0.0,
loopback, multicast, broadcast) are dropped; and a name heard with two IPv4 addresses, or
one already in the inventory announcing a new address, is a conflict: reported and left
out, never written in place of what was there.
"""

from __future__ import annotations

import getpass
import ipaddress
import os
import re
import sys
import threading
import time
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paramiko
import yaml

from meshtrain import yaml12
from meshtrain.errors import InputError
from meshtrain.hosts.host_output import visible
from meshtrain.hosts.inventory import Host, Inventory, InventoryError, load_inventory, parse_inventory

SERVICE = "_ssh._tcp.local."
INSTALL_HINT = "pip install 'meshtrain[discover]'"
RESOLVE_S = 1.5  # of the timeout, kept at its end to ask the services heard for their addresses
MAX_HOSTS = 128  # machines one discovery considers (a flood of announcements is cut there)
RESOLVERS = 16  # services asked for their addresses at once
_NOT_NAME = re.compile(r"[^A-Za-z0-9_.-]+")

# What a key check can say about a host (``--check-keys``).
ACCEPTED = "accepted"
REFUSED = "refused"
HOST_KEY_UNKNOWN = "host-key-unknown"
HOST_KEY_CHANGED = "host-key-changed"
HOST_KEY_REVOKED = "host-key-revoked"
NEEDS_AGENT = "key-needs-agent"
UNREACHABLE = "unreachable"


class DiscoveryError(InputError, RuntimeError):
    """Discovery cannot run as asked; the message is one line naming the fault."""


class ZeroconfMissing(DiscoveryError):
    """The optional ``zeroconf`` package is not installed."""

    def __init__(self) -> None:
        super().__init__(f"discovery needs the zeroconf package: {INSTALL_HINT}")


@dataclass(frozen=True)
class Found:
    """One machine that advertised SSH."""

    service: str  # the advertised instance name ("Alice's MacBook Pro")
    server: str  # its mDNS host name, without the final dot ("Alices-MacBook-Pro.local")
    addresses: tuple[str, ...]  # IPv4 first
    port: int

    @property
    def address(self) -> str:
        """The address the inventory uses: the first IPv4 one when there is one."""
        return self.addresses[0]


@dataclass
class Discovery:
    """What :func:`browse` found: the usable machines, and one line per thing it left out
    (a conflict, a flood past :data:`MAX_HOSTS`, names that did not answer in time)."""

    found: list[Found]
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0  # how long it took, resolution included


@dataclass(frozen=True)
class KeyCheck:
    """The outcome of one public-key login attempt."""

    status: str  # ACCEPTED, REFUSED, HOST_KEY_UNKNOWN, ...
    detail: str  # the one-line reason from meshtrain.hosts.ssh ("" when accepted)


def require_zeroconf() -> Any:
    """The ``zeroconf`` module, or :class:`ZeroconfMissing` (one line naming the extra)."""
    try:
        import zeroconf
    except ImportError:
        raise ZeroconfMissing() from None
    return zeroconf


def interface_addresses(iface: str) -> list[str]:
    """The IPv4 addresses of network interface ``iface``; raises :class:`DiscoveryError`."""
    require_zeroconf()
    import ifaddr  # installed with zeroconf, which uses it to list interfaces

    for adapter in ifaddr.get_adapters():
        if adapter.nice_name == iface or adapter.name == iface:
            found = [str(ip.ip) for ip in adapter.ips if isinstance(ip.ip, str)]
            if not found:
                raise DiscoveryError(f"--iface {iface}: the interface has no IPv4 address")
            return found
    names = ", ".join(sorted({a.nice_name for a in ifaddr.get_adapters()}))
    raise DiscoveryError(f"--iface {iface}: no such interface (here: {names})")


def parse_network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """A ``--network`` value such as ``192.168.1.0/24``; raises :class:`DiscoveryError`."""
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise DiscoveryError(f"--network {text}: expected an address range such as 192.168.1.0/24") from None


def browse(timeout: float, *, iface: str | None = None,
           network: ipaddress.IPv4Network | ipaddress.IPv6Network | None = None,
           known: Mapping[str, str] | None = None) -> Discovery:
    """Listen for ``_ssh._tcp`` announcements and resolve each one, all within ``timeout``
    seconds (the last :data:`RESOLVE_S` of it, at most half, for resolving).

    ``iface`` limits listening to one interface; ``network`` keeps only addresses inside
    it (a machine left with none is dropped). ``known`` maps the names of an inventory being
    replaced to their addresses: such a name announced at another address is a conflict.
    Sorted by host name.
    """
    zc_mod = require_zeroconf()
    started = time.monotonic()
    deadline = started + timeout
    interfaces = interface_addresses(iface) if iface else zc_mod.InterfaceChoice.All
    names: dict[str, None] = {}  # in the order heard, at most MAX_HOSTS
    flooded = threading.Event()
    heard: dict[str, set[str]] = {}  # every address record heard, by host name

    def on_change(zeroconf: Any, service_type: str, name: str, state_change: Any) -> None:
        if state_change is not zc_mod.ServiceStateChange.Removed and name not in names:
            if len(names) < MAX_HOSTS:
                names[name] = None
            else:
                flooded.set()

    def keep_addresses(listener: Any, zc: Any, now: float, records: list[Any]) -> None:
        """Keeps every A/AAAA record heard: a later one may replace an earlier in the cache."""
        for update in records:
            record = update.new
            if isinstance(record, zc_mod.DNSAddress) and len(heard) < 4 * MAX_HOSTS:
                try:
                    address = str(ipaddress.ip_address(record.address))
                except ValueError:
                    continue
                found = heard.setdefault(record.name.lower().rstrip("."), set())
                if len(found) < 16:
                    found.add(address)

    listener = type("AddressRecords", (zc_mod.RecordUpdateListener,),
                    {"async_update_records": keep_addresses})
    broadcasts = _local_broadcasts()
    zc = zc_mod.Zeroconf(interfaces=interfaces)
    try:
        zc.add_listener(listener(), None)
        browser = zc_mod.ServiceBrowser(zc, SERVICE, handlers=[on_change])
        time.sleep(max(0.0, deadline - min(RESOLVE_S, timeout / 2) - time.monotonic()))
        browser.cancel()
        asked = list(names)
        with ThreadPoolExecutor(max_workers=RESOLVERS) as pool:
            resolved = list(pool.map(lambda name: _resolve(zc, zc_mod, name, deadline, broadcasts), asked))
    finally:
        zc.close()
    problems = []
    if flooded.is_set():
        problems.append(f"more than {MAX_HOSTS} machines announced SSH: only the first {MAX_HOSTS} heard "
                        "were considered (a flood of announcements?)")
    unanswered = sum(r is None for r in resolved)
    if unanswered:
        problems.append(f"{unanswered} announced name{'s' if unanswered > 1 else ''} did not answer "
                        f"within {timeout:g} s (left out)")
    found, more = checked(
        [f for f in resolved if f is not None and f is not _NOT_USABLE], heard, network, known or {})
    problems += more
    unusable = sum(r is _NOT_USABLE for r in resolved)
    if unusable:
        problems.append(f"{unusable} announcement{'s' if unusable > 1 else ''} with no usable name or "
                        "address (0.0.0.0, loopback, multicast, broadcast): left out")
    return Discovery(sorted(found, key=lambda f: (f.server.lower(), f.service)), problems,
                     time.monotonic() - started)


def _resolve(zc: Any, zc_mod: Any, name: str, deadline: float,
             broadcasts: set[ipaddress.IPv4Address]) -> Found | None:
    """The machine behind the announced ``name``: None if it did not answer by ``deadline``,
    :data:`_NOT_USABLE` if it announced a name zeroconf refuses or no address a machine can
    be reached at."""
    wait_ms = int((deadline - time.monotonic()) * 1000)
    try:
        info = zc_mod.ServiceInfo(SERVICE, name)
        if not info.load_from_cache(zc) and (wait_ms <= 0 or not info.request(zc, wait_ms)):
            return None  # announced, then gone (or never answered): nothing to log in to
        if not info.port:
            return None
    except zc_mod.Error:
        return _NOT_USABLE  # a name zeroconf refuses (control characters, too long): a stranger's
    addresses = [a for a in info.parsed_scoped_addresses() if usable_address(a, broadcasts)]
    if not addresses:
        return _NOT_USABLE
    addresses.sort(key=lambda a: ipaddress.ip_address(a.split("%")[0]).version)  # IPv4 first
    # Anyone on the LAN may announce anything: control characters (a newline would end the
    # inventory comment that quotes the name, an escape sequence would reach the terminal)
    # are written out before the names are used anywhere.
    service = visible(name[: -len(SERVICE) - 1] if name.endswith("." + SERVICE) else name)
    server = visible((info.server or "").rstrip(".")) or service
    return Found(service=service, server=server, addresses=tuple(addresses), port=int(info.port))


#: What :func:`_resolve` returns for a machine announcing no usable address.
_NOT_USABLE = Found("", "", ("0.0.0.0",), 0)


def known_addresses(path: Path | None) -> dict[str, str]:
    """Host name to address of the inventory at ``path`` that a discovery may replace;
    empty when there is none, or it cannot be read (it is then not an inventory to keep)."""
    if path is None or not path.is_file():
        return {}
    try:
        return {host.name: host.hostname for host in load_inventory(path).hosts}
    except (InventoryError, OSError):
        return {}


def _local_broadcasts() -> set[ipaddress.IPv4Address]:
    """The broadcast addresses of this machine's IPv4 networks."""
    import ifaddr  # installed with zeroconf

    out: set[ipaddress.IPv4Address] = set()
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and ip.network_prefix < 31:
                out.add(ipaddress.IPv4Network(f"{ip.ip}/{ip.network_prefix}", strict=False).broadcast_address)
    return out


def usable_address(text: str, broadcasts: Collection[ipaddress.IPv4Address] = ()) -> bool:
    """Whether a machine can be reached at the announced address ``text``: not unspecified
    (0.0.0.0, ::), loopback, multicast, reserved, the broadcast address or one of ``broadcasts``."""
    try:
        address = ipaddress.ip_address(text.split("%")[0])
    except ValueError:
        return False
    if address.is_unspecified or address.is_loopback or address.is_multicast or address.is_reserved:
        return False
    return not (isinstance(address, ipaddress.IPv4Address)
                and (address == ipaddress.IPv4Address("255.255.255.255") or address in broadcasts))


def checked(found: list[Found], heard: Mapping[str, set[str]],
            network: ipaddress.IPv4Network | ipaddress.IPv6Network | None,
            known: Mapping[str, str]) -> tuple[list[Found], list[str]]:
    """``found`` less the machines outside ``network`` and the conflicts, and one line per
    conflict. A conflict: a name heard with two IPv4 addresses (by one announcement, two,
    or address records that replaced each other: ``heard``), or a name of ``known`` (an
    inventory's, name to address) announced at an address it does not have there."""
    kept = [f for f in (_only_in(f, network) for f in found) if f is not None]
    by_name: dict[str, list[Found]] = {}
    for f in kept:
        by_name.setdefault(host_name(f), []).append(f)
    out, problems = [], []
    for name, group in by_name.items():
        addresses = {a for f in group for a in f.addresses}
        addresses |= {a for f in group for a in heard.get(f.server.lower(), set())
                      if usable_address(a) and _only_in(Found("", "", (a,), 0), network) is not None}
        ipv4 = sorted(a for a in addresses if ipaddress.ip_address(a.split("%")[0]).version == 4)
        if len(ipv4) > 1:
            problems.append(f"conflict: {name} was announced with {len(ipv4)} addresses ({', '.join(ipv4)}): "
                            "another machine may be claiming its name; left out (add it by hand, or narrow "
                            "with --network)")
            continue
        if name in known and known[name] not in addresses:
            problems.append(f"conflict: {name} is at {known[name]} in the inventory, but now announced at "
                            f"{group[0].address}; left out (edit the inventory by hand if it moved)")
            continue
        out.append(group[0])
    return out, problems


def _only_in(found: Found, network: ipaddress.IPv4Network | ipaddress.IPv6Network | None) -> Found | None:
    if network is None:
        return found
    inside = tuple(a for a in found.addresses if ipaddress.ip_address(a.split("%")[0]) in network)
    return Found(found.service, found.server, inside, found.port) if inside else None


def host_name(found: Found) -> str:
    """An inventory ``name`` for a machine: its mDNS host name without ``.local``."""
    base = found.server[: -len(".local")] if found.server.endswith(".local") else found.server
    name = _NOT_NAME.sub("-", base or found.service).strip("-.") or "host"
    return name if name[0].isalnum() else f"host-{name}"


def inventory_dict(found: list[Found], *, user: str | None = None, python: str | None = None,
                   identity_file: str | None = None, known_hosts: str | None = None) -> dict[str, Any]:
    """A starter inventory for ``found`` (rank 0 first), in the format the launcher reads.

    ``python`` defaults to this interpreter (right where every host was set up alike);
    names are made unique with a numeric suffix.
    """
    defaults: dict[str, Any] = {"user": user or getpass.getuser(), "python": python or sys.executable}
    if identity_file:
        defaults["identity_file"] = identity_file
    if known_hosts:
        defaults["known_hosts"] = known_hosts
    defaults.update(workdir="~/meshtrain-runs", device="auto")
    hosts: list[dict[str, Any]] = []
    used: set[str] = set()
    for f in found:
        name, n = host_name(f), 2
        while name in used:
            name, n = f"{host_name(f)}-{n}", n + 1
        used.add(name)
        entry: dict[str, Any] = {"name": name, "host": f.address, "advertise": f.address.split("%")[0]}
        if f.port != 22:
            entry["port"] = f.port
        hosts.append(entry)
    return {"defaults": defaults, "rendezvous": {"port": 29500}, "hosts": hosts}


def inventory_text(raw: dict[str, Any], found: list[Found], checks: dict[str, KeyCheck] | None,
                   where: Path) -> str:
    """The inventory as YAML with a comment per host (its advertised name, key status),
    checked by loading it back with the launcher's own parser."""
    lines = [
        "# Written by `meshtrain hosts discover`: machines that advertised SSH on this network.",
        "# Check user and python (absolute path on the hosts), put rank 0 first, then:",
        f"#   meshtrain hosts check {where}",
        "",
        yaml.safe_dump({"defaults": raw["defaults"], "rendezvous": raw["rendezvous"]}, sort_keys=False),
        "hosts:",
    ]
    for entry, f in zip(raw["hosts"], found, strict=True):
        # One comment line whatever was announced (Found's names are already visible(); this
        # holds for a Found made elsewhere too).
        note = visible(f"{f.service} ({f.server}, {', '.join(f.addresses)})")
        if checks is not None:
            note += f", key {checks[entry['name']].status}"
        lines.append(f"  # {note}")
        lines.append(_indent(yaml.safe_dump([entry], sort_keys=False)))
    text = "\n".join(lines) + "\n"
    parse_inventory(yaml12.load(text), where)  # raises InventoryError: never write what cannot load
    return text


def _indent(block: str) -> str:
    return "\n".join(f"  {line}" for line in block.rstrip("\n").splitlines())


def check_keys(inventory: Inventory, *, timeout: float = 10.0) -> dict[str, KeyCheck]:
    """Try a public-key login on every host of ``inventory`` (in parallel) with its user,
    keys (identity_file, else ssh-agent and ~/.ssh/id_*) and known_hosts, exactly as the
    launcher would; unknown host keys are refused, never recorded; no password is ever
    tried. Each connection is closed at once: nothing runs on the host. Keyed by name."""
    if not inventory.hosts:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(inventory.hosts))) as pool:
        results = pool.map(lambda h: (h.name, _check_one(h, timeout)), inventory.hosts)
        return dict(results)


def _check_one(host: Host, timeout: float) -> KeyCheck:
    # Deferred: the SSH stack (paramiko) loads only when keys are checked.
    from meshtrain.hosts.ssh import RevokedHostKey, SSHError, UnknownHostKey, connect

    try:
        client = connect(host, accept_new_host_keys=False, timeout=timeout)
    except SSHError as exc:
        # connect() re-raises every failure as one SSHError line; the paramiko exception it
        # replaced is still its __context__, and tells the kinds apart reliably.
        cause = exc.__context__
        if isinstance(cause, UnknownHostKey):
            status = HOST_KEY_UNKNOWN
        elif isinstance(cause, RevokedHostKey):
            status = HOST_KEY_REVOKED
        elif isinstance(cause, paramiko.BadHostKeyException):
            status = HOST_KEY_REVOKED if "revoked" in str(exc) else HOST_KEY_CHANGED
        elif isinstance(cause, paramiko.PasswordRequiredException):
            status = NEEDS_AGENT
        elif isinstance(cause, paramiko.AuthenticationException):
            status = REFUSED
        else:
            status = UNREACHABLE
        return KeyCheck(status, str(exc))
    client.close()
    return KeyCheck(ACCEPTED, "")


def write_inventory(path: Path, text: str, *, force: bool) -> None:
    """Write ``text`` to ``path`` atomically (a temporary file renamed into place). Without
    ``force`` an existing file is never replaced, even one created meanwhile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    try:
        if force:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails if path exists: no window for a silent overwrite
            except FileExistsError:
                raise DiscoveryError(f"--write {path}: the file exists; pass --force to replace it") from None
    finally:
        tmp.unlink(missing_ok=True)

