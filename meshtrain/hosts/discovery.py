"""Find machines on the LAN that offer SSH, the way Macs already announce it (Bonjour).

A Mac with Remote Login on (and any host running avahi's ssh service) advertises
``_ssh._tcp.local.`` over multicast DNS. :func:`browse` listens for those announcements
for a few seconds, :func:`check_keys` (only when asked) tries a public-key login on each
one found, and :func:`inventory_text` turns them into a starter inventory that
:mod:`meshtrain.hosts.inventory` reads. Browsing needs the optional ``zeroconf`` package
(``pip install 'meshtrain[discover]'``); nothing else here connects anywhere.
"""

from __future__ import annotations

import getpass
import ipaddress
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paramiko
import yaml

from meshtrain import yaml12
from meshtrain.errors import InputError
from meshtrain.hosts.host_output import visible
from meshtrain.hosts.inventory import Host, Inventory, parse_inventory

SERVICE = "_ssh._tcp.local."
INSTALL_HINT = "pip install 'meshtrain[discover]'"
RESOLVE_MS = 1500  # how long to ask a found service for its address and port
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
           network: ipaddress.IPv4Network | ipaddress.IPv6Network | None = None) -> list[Found]:
    """Listen ``timeout`` seconds for ``_ssh._tcp`` announcements and resolve each one.

    ``iface`` limits listening to one interface; ``network`` keeps only addresses inside
    it (a machine left with none is dropped). Sorted by host name.
    """
    zc_mod = require_zeroconf()
    interfaces = interface_addresses(iface) if iface else zc_mod.InterfaceChoice.All
    names: set[str] = set()

    def on_change(zeroconf: Any, service_type: str, name: str, state_change: Any) -> None:
        if state_change is not zc_mod.ServiceStateChange.Removed:
            names.add(name)

    zc = zc_mod.Zeroconf(interfaces=interfaces)
    try:
        browser = zc_mod.ServiceBrowser(zc, SERVICE, handlers=[on_change])
        time.sleep(timeout)  # answers arrive on zeroconf's own thread
        browser.cancel()
        found = [_resolve(zc, zc_mod, name) for name in sorted(names)]
    finally:
        zc.close()
    kept = [f for f in (_only_in(f, network) for f in found if f is not None) if f is not None]
    return sorted(kept, key=lambda f: (f.server.lower(), f.service))


def _resolve(zc: Any, zc_mod: Any, name: str) -> Found | None:
    try:
        info = zc_mod.ServiceInfo(SERVICE, name)
        if not info.request(zc, RESOLVE_MS) or not info.port:
            return None  # announced, then gone (or never answered): nothing to log in to
    except zc_mod.Error:
        return None  # a name zeroconf refuses (control characters, too long): a stranger's, ignored
    addresses = info.parsed_scoped_addresses()
    if not addresses:
        return None
    addresses.sort(key=lambda a: ipaddress.ip_address(a.split("%")[0]).version)  # IPv4 first
    # Anyone on the LAN may announce anything: control characters (a newline would end the
    # inventory comment that quotes the name, an escape sequence would reach the terminal)
    # are written out before the names are used anywhere.
    service = visible(name[: -len(SERVICE) - 1] if name.endswith("." + SERVICE) else name)
    server = visible((info.server or "").rstrip(".")) or service
    return Found(service=service, server=server, addresses=tuple(addresses), port=int(info.port))


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

