"""The inventory: which machines a launched run uses, read from a YAML file.

    defaults: {user: alice, python: /opt/homebrew/bin/python3, device: auto}
    rendezvous: {port: 29500, timeout: 1800, heartbeat_timeout: 30}
    hosts:
      - {name: studio-1, host: 192.168.1.101, iface: en0, threads: 8}
      - {name: studio-2, host: studio-2.local}

Rank 0 is the first host. Every error names the file, the host and the key at fault.
Paths to SSH files (identity_file, known_hosts, ssh_config) are local; ``python`` and
``workdir`` are paths on the host (absolute, or starting with ``~``).
"""

from __future__ import annotations

import getpass
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paramiko
import yaml

from meshtrain import yaml12
from meshtrain.config.settings import MAX_THREADS
from meshtrain.devices import DEVICES
from meshtrain.errors import InputError

# Keys a host entry may set; every one except name/host/advertise may also go in defaults.
HOST_ONLY_KEYS = ("name", "host", "advertise", "link_bandwidth")
SHARED_KEYS = ("user", "port", "identity_file", "known_hosts", "ssh_config", "python", "workdir",
               "device", "env", "iface", "threads")
TOP_KEYS = ("defaults", "rendezvous", "hosts")
RENDEZVOUS_KEYS = ("port", "timeout", "heartbeat_timeout")
# The launcher sets these on every rank; an inventory setting them would break the run.
RESERVED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "MESHTRAIN_TIMEOUT", "MESHTRAIN_RUN_ID", "GLOO_SOCKET_IFNAME", "MESHTRAIN_HEARTBEAT",
                "MESHTRAIN_HEARTBEAT_FD", "MESHTRAIN_PEERS", "MESHTRAIN_SECRET_FILE", "MESHTRAIN_ADVERTISE")
SECRET_WORDS = ("password", "passphrase", "secret")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_IFACE = re.compile(r"^[A-Za-z0-9_.:@-]+$")
# A hostname, an IPv4 or IPv6 address (``%`` scopes a link-local one) or an ssh config alias.
_ADDRESS = re.compile(r"^[A-Za-z0-9_.:%-]+$")


class InventoryError(InputError):
    """A bad inventory: the message is one line naming the file, the host and the key."""


@dataclass(frozen=True)
class Rendezvous:
    """Where ranks meet: rank 0's ``advertise`` address at ``port``."""

    port: int = 29500
    timeout: float = 1800.0  # seconds a collective may wait (a straggler on a slow Mac)
    heartbeat_timeout: float = 30.0  # a rank silent this long is hung: the run stops


@dataclass(frozen=True)
class Host:
    """One machine of the inventory, with defaults and ~/.ssh/config applied."""

    name: str
    rank: int
    host: str  # as written: an address or an ~/.ssh/config alias
    hostname: str  # what SSH connects to (the alias resolved)
    advertise: str  # the address other ranks use to reach this host
    user: str
    port: int
    identity_file: str | None  # local path; None: ssh-agent and ~/.ssh/id_* keys
    known_hosts: str  # local path
    python: str  # interpreter on the host
    workdir: str  # folder on the host where runs are written
    device: str = "auto"
    env: dict[str, str] = field(default_factory=dict)
    iface: str | None = None  # GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME unless env sets it)
    threads: int | None = None  # torch intra-op threads of this rank (None: its machine's cores, shared)
    link_bandwidth: float | None = None  # bytes/s `hosts bench` measured to ``advertise`` (a record only)

    @property
    def label(self) -> str:
        """``user@hostname:port``, for messages."""
        return f"{self.user}@{self.hostname}:{self.port}"


@dataclass(frozen=True)
class Inventory:
    """The hosts of a launched run, in rank order, and the rendezvous settings."""

    path: Path
    hosts: tuple[Host, ...]
    rendezvous: Rendezvous

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    @property
    def master(self) -> Host:
        """Rank 0, whose ``advertise`` address is MASTER_ADDR for every rank."""
        return self.hosts[0]


def load_inventory(path: str | os.PathLike[str]) -> Inventory:
    """Read and check an inventory file; raises :class:`InventoryError` naming the fault."""
    path = Path(path)
    if not path.is_file():
        raise InventoryError(f"{path}: inventory file not found")
    try:
        raw = yaml12.read(path)
    except yaml.YAMLError as exc:
        raise InventoryError(f"{path}: {yaml12.problem(exc)}") from None
    return parse_inventory(raw, path)


def parse_inventory(raw: Any, path: Path) -> Inventory:
    """Check an already-parsed inventory mapping (``path`` is only used in messages)."""
    if not isinstance(raw, dict):
        raise InventoryError(f"{path}: expected a mapping with keys {', '.join(TOP_KEYS)}")
    _check_keys(raw, TOP_KEYS, f"{path}")
    defaults = raw.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise InventoryError(f"{path}: 'defaults' must be a mapping")
    _check_keys(defaults, SHARED_KEYS, f"{path}: defaults")
    _check_env_mapping(defaults.get("env"), f"{path}: defaults")
    rendezvous = _parse_rendezvous(raw.get("rendezvous") or {}, path)

    entries = raw.get("hosts")
    if not isinstance(entries, list) or not entries:
        raise InventoryError(f"{path}: 'hosts' must be a non-empty list (rank 0 first)")
    hosts: list[Host] = []
    seen: set[str] = set()
    for rank, entry in enumerate(entries):
        where = f"{path}: hosts[{rank}]"
        if not isinstance(entry, dict):
            raise InventoryError(f"{where}: expected a mapping with at least 'name' and 'host'")
        if isinstance(entry.get("name"), str):
            where = f"{path}: host {entry['name']!r}"
        _check_keys(entry, HOST_ONLY_KEYS + SHARED_KEYS, where)
        host = _parse_host(defaults, entry, rank, where)
        if host.name in seen:
            raise InventoryError(f"{where}: duplicate name {host.name!r} (names must be unique)")
        seen.add(host.name)
        hosts.append(host)
    return Inventory(path=path, hosts=tuple(hosts), rendezvous=rendezvous)


def _check_keys(mapping: dict[Any, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in mapping:
        if any(word in str(key).lower() for word in SECRET_WORDS):
            raise InventoryError(
                f"{where}: key {key!r}: no passwords in the inventory; use an SSH key "
                "(identity_file) or ssh-agent"
            )
        if key not in allowed:
            raise InventoryError(f"{where}: unknown key {key!r} (allowed: {', '.join(allowed)})")


def _parse_rendezvous(raw: Any, path: Path) -> Rendezvous:
    where = f"{path}: rendezvous"
    if not isinstance(raw, dict):
        raise InventoryError(f"{where}: expected a mapping with keys {', '.join(RENDEZVOUS_KEYS)}")
    _check_keys(raw, RENDEZVOUS_KEYS, where)
    port = _port(raw.get("port", Rendezvous.port), f"{where}: key 'port'")
    seconds = {}
    for key in ("timeout", "heartbeat_timeout"):
        value = raw.get(key, getattr(Rendezvous, key))
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
                or value == float("inf")):
            raise InventoryError(f"{where}: key {key!r}: expected seconds > 0, got {value!r}")
        seconds[key] = float(value)
    return Rendezvous(port=port, **seconds)


def parse_threads(value: Any, where: str) -> int:
    """A thread count: a whole number >= 1 (``where`` names the file, host and key)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS:
        raise InventoryError(f"{where}: expected a whole number of threads from 1 to {MAX_THREADS}, "
                             f"got {value!r}")
    return value


def _port(value: Any, where: str) -> int:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise InventoryError(f"{where}: bad port {value!r} (expected an integer 1-65535)")
    return value


def _text(value: Any, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or str(value) == "":
        raise InventoryError(f"{where}: expected a non-empty string, got {value!r}")
    return str(value)


def _remote_path(value: Any, where: str) -> str:
    text = _text(value, where)
    if not (text.startswith("/") or text == "~" or text.startswith("~/")):
        raise InventoryError(
            f"{where}: {text!r} must be an absolute path on the host (or start with ~/): "
            "non-interactive SSH does not read your shell profile, so PATH lookups are unreliable"
        )
    return text


def _address(value: Any, where: str) -> str:
    text = _text(value, where)
    if not _ADDRESS.match(text):
        raise InventoryError(f"{where}: {text!r} is not a hostname, IP address or ssh config alias "
                             "(letters, digits, '.', '-', '_', ':' and '%')")
    return text


def _parse_host(defaults: dict[str, Any], entry: dict[str, Any], rank: int, where: str) -> Host:
    merged = {**defaults, **entry}
    _check_env_mapping(entry.get("env"), where)
    merged["env"] = {**(defaults.get("env") or {}), **(entry.get("env") or {})}
    name = merged.get("name")
    if name is None:
        raise InventoryError(f"{where}: missing key 'name'")
    name = _text(name, f"{where}: key 'name'")
    if not _NAME.match(name):
        raise InventoryError(f"{where}: key 'name': {name!r} may use letters, digits, '.', '_' and '-'")
    if "host" not in entry:
        raise InventoryError(f"{where}: missing key 'host' (an address or ~/.ssh/config alias)")
    alias = _address(entry["host"], f"{where}: key 'host'")

    ssh_cfg = _ssh_config(merged.get("ssh_config"), alias, where)
    hostname = ssh_cfg.get("hostname", alias)
    user = merged.get("user", ssh_cfg.get("user") or getpass.getuser())
    port = _port(merged.get("port", ssh_cfg.get("port", 22)), f"{where}: key 'port'")
    identity = merged.get("identity_file")
    if identity is None and ssh_cfg.get("identityfile"):
        identity = ssh_cfg["identityfile"][0]
    if identity is not None:
        identity = os.path.expanduser(_text(identity, f"{where}: key 'identity_file'"))
    known_hosts = os.path.expanduser(
        _text(merged.get("known_hosts", "~/.ssh/known_hosts"), f"{where}: key 'known_hosts'")
    )
    if "python" not in merged:
        raise InventoryError(
            f"{where}: missing key 'python' (the absolute path of the interpreter with meshtrain "
            "installed on that host; set it under defaults or per host)"
        )
    python = _remote_path(merged["python"], f"{where}: key 'python'")
    workdir = _remote_path(merged.get("workdir", "~/meshtrain-runs"), f"{where}: key 'workdir'")
    device = _text(merged.get("device", "auto"), f"{where}: key 'device'")
    if device.split(":")[0] not in DEVICES:
        raise InventoryError(f"{where}: key 'device': {device!r} is not one of {', '.join(DEVICES)}")
    env = _parse_env(merged["env"], where)
    iface = merged.get("iface")
    if iface is not None:
        iface = _text(iface, f"{where}: key 'iface'")
        if not _IFACE.match(iface):
            raise InventoryError(f"{where}: key 'iface': {iface!r} is not an interface name")
    advertise = _address(merged.get("advertise", hostname), f"{where}: key 'advertise'")
    threads = merged.get("threads")
    if threads is not None:
        threads = parse_threads(threads, f"{where}: key 'threads'")
    link_bandwidth = merged.get("link_bandwidth")
    if link_bandwidth is not None and (isinstance(link_bandwidth, bool)
                                       or not isinstance(link_bandwidth, (int, float))
                                       or not 0 < link_bandwidth < float("inf")):
        raise InventoryError(f"{where}: key 'link_bandwidth': expected bytes per second > 0, "
                             f"got {link_bandwidth!r}")
    return Host(
        name=name, rank=rank, host=alias, hostname=hostname, advertise=advertise,
        user=_text(user, f"{where}: key 'user'"), port=port, identity_file=identity,
        known_hosts=known_hosts, python=python, workdir=workdir, device=device, env=env, iface=iface,
        threads=threads, link_bandwidth=None if link_bandwidth is None else float(link_bandwidth),
    )


def _check_env_mapping(env: Any, where: str) -> None:
    """``env`` must be a mapping: a YAML list (``- NAME=value``) is the usual slip."""
    if env is not None and not isinstance(env, dict):
        kinds: dict[type, str] = {list: "a list", str: "text"}
        kind = kinds.get(type(env), type(env).__name__)
        raise InventoryError(f"{where}: key 'env' must be a mapping of NAME: value (one per line), "
                             f"got {kind} {env!r}")


def _parse_env(env: Any, where: str) -> dict[str, str]:
    if not isinstance(env, dict):
        raise InventoryError(f"{where}: key 'env' must be a mapping of NAME: value")
    out: dict[str, str] = {}
    for key, value in env.items():
        key = str(key)
        if not _ENV_NAME.match(key):
            raise InventoryError(f"{where}: key 'env': {key!r} is not a valid variable name")
        if key == "MESHTRAIN_THREADS":
            raise InventoryError(f"{where}: key 'env': set the thread count with 'threads', not "
                                 "MESHTRAIN_THREADS")
        if key in RESERVED_ENV:
            raise InventoryError(f"{where}: key 'env': {key} is set by the launcher for each rank")
        if isinstance(value, (dict, list)) or value is None:
            raise InventoryError(f"{where}: key 'env.{key}': expected a string, got {value!r}")
        out[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return out


def _ssh_config(path: Any, alias: str, where: str) -> dict[str, Any]:
    """The ~/.ssh/config entries for ``alias`` (hostname, user, port, identityfile)."""
    explicit = path is not None
    file = Path(os.path.expanduser(_text(path, f"{where}: key 'ssh_config'") if explicit
                                   else "~/.ssh/config"))
    if not file.exists():
        if explicit:
            raise InventoryError(f"{where}: key 'ssh_config': {file} does not exist")
        return {}
    try:
        config = paramiko.SSHConfig.from_path(str(file))
        return dict(config.lookup(alias))
    except Exception as exc:  # noqa: BLE001 - paramiko raises several kinds on odd files
        raise InventoryError(f"{where}: could not read SSH config {file}: {exc}") from None

