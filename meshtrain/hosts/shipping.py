"""Ship the data and the local model a run reads into every host's workdir.

    shipment = hash_path("--data", Path("my-recordings"))    # hashes every file here
    argv = [..., "--data", shipment.remote]                  # .meshtrain/data/<tree>/my-recordings
    ship_to_hosts([(host, client), ...], [shipment], note=print)

Content-addressed: each host keeps every file's bytes once, as
``<workdir>/.meshtrain/blobs/<sha256>``, and the rank reads
``<workdir>/.meshtrain/data/<tree>/<name>``, hardlinks to those blobs (the host side is
:mod:`meshtrain.hosts.blobstore`). One round trip asks a host which blobs it lacks, so a
second launch sends nothing and a changed file in a big folder sends only that file.
Every host needs room for what it lacks (plus a margin) before anything is sent.
Uploads go to a temporary folder over SFTP (a tar stream where the host has no SFTP
server) and become blobs only after the host has checked their hashes.

Every rank receives the whole folder: the speech task reads every clip's header and
transcript before the first step, and picks its shard from the full list.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import secrets
import tarfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import paramiko

from meshtrain.errors import InputError
from meshtrain.hosts import blobstore
from meshtrain.hosts.host_output import host_json, visible
from meshtrain.hosts.inventory import Host
from meshtrain.hosts.ssh import HostPath, OutputTooLarge, Shell, run, sh, shell_line
from meshtrain.hosts.transfer import POLL_SECONDS, has_sftp, has_tar, sftp_path
from meshtrain.progress import human_bytes

MARGIN_BYTES = 50_000_000  # room kept free on a host beyond what is shipped (the run writes too)
PER_FILE_BYTES = 4096  # a file's share of directory entries and partly filled blocks
QUERY_TIMEOUT = 60.0  # seconds a host may take to answer, plus time to hash what it holds:
HASH_RATE = 50e6  # bytes per second a slow host's disk and sha256 manage
STALL_TIMEOUT = 60.0  # seconds an upload may go without progress
ANSWER_MAX_BYTES = 64 << 20  # a host's answer to a query: its list of missing files, ~70 bytes each
ANSWER_KEYS = {"query": ("missing", "free", "trees_ok"), "finish": ("bad", "absent")}

T = TypeVar("T")
_Destination = tuple[Host, paramiko.SSHClient, list[str]]  # a workdir: one host, the names sharing it


class ShipError(InputError, RuntimeError):
    """Shipping failed before any rank started: one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        problems = [visible(p) for p in problems]  # a problem may quote what a host said
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ShipFile:
    """One local file of a shipment."""

    rel: str  # its path in the tree, "/"-separated, starting with the shipment's name
    sha256: str
    size: int
    local: Path


@dataclass(frozen=True)
class Shipment:
    """A local file or folder a run reads, hashed, and where every rank finds it."""

    what: str  # the flag or key that names it: "--data", "task_options.model"
    local: Path
    name: str  # the folder or file name the rank sees (the local one)
    files: tuple[ShipFile, ...]
    tree: str  # sha256 over every file's path and hash

    @property
    def remote(self) -> str:
        """The path a rank reads it at, relative to its workdir."""
        return f"{blobstore.TREES}/{self.tree}/{self.name}"

    @property
    def size(self) -> int:
        """Bytes in all its files."""
        return sum(f.size for f in self.files)


@dataclass
class ShipReport:
    """What shipping did for one workdir (the hosts that share it)."""

    hosts: list[str]
    files_sent: int
    bytes_sent: int
    bytes_present: int
    seconds: float


def hash_path(what: str, local: Path) -> Shipment:
    """Hash the file or every file under the folder ``local`` (symlinks followed).

    Raises ShipError when it does not exist or a file cannot be read.
    """
    if not local.exists():
        raise ShipError([f"{what} {local}: no such file or folder here (a path that exists only on "
                         "the hosts needs --no-ship)"])
    root = local.resolve()
    name = local.name if local.name not in ("", ".", "..") else root.name or "data"
    found: list[tuple[str, Path]] = []
    if root.is_file():
        found.append((name, root))
    else:
        for folder, dirs, names in os.walk(root, followlinks=True):
            dirs.sort()
            for n in sorted(names):
                path = Path(folder) / n
                if path.is_file():
                    found.append(((Path(name) / path.relative_to(root)).as_posix(), path))
    files = []
    try:
        for rel, path in found:
            files.append(ShipFile(rel, blobstore.sha256_file(str(path)), path.stat().st_size, path))
    except OSError as exc:
        raise ShipError([f"{what} {local}: cannot read {exc.filename}: {exc.strerror}"]) from None
    listing = json.dumps([[f.rel, f.sha256] for f in files]).encode()
    return Shipment(what, local, name, tuple(files), hashlib.sha256(listing).hexdigest())


def ship_to_hosts(targets: list[tuple[Host, paramiko.SSHClient]], shipments: list[Shipment],
                  note: Callable[[str], None],
                  check_stop: Callable[[], None] = lambda: None) -> list[ShipReport]:
    """Make every shipment readable at its ``remote`` path in each host's workdir.

    Hosts sharing a workdir (two ranks on one machine) are shipped to once. Every host is
    asked first; a host without room for what it lacks stops the launch before anything
    is sent. ``note`` gets one line per workdir and a total. Raises ShipError.

    ``check_stop`` is called every :data:`POLL_SECONDS` while the hosts work; what it
    raises (or Ctrl-C) closes every connection, which ends the uploads at once.
    """
    started = time.monotonic()
    groups: dict[tuple[str, int, str, str], list[tuple[Host, paramiko.SSHClient]]] = {}
    for host, client in targets:
        groups.setdefault((host.hostname, host.port, host.user, host.workdir), []).append((host, client))
    destinations = [(group[0][0], group[0][1], [h.name for h, _ in group]) for group in groups.values()]
    blobs = {f.sha256: f for s in shipments for f in s.files}
    pool = ThreadPoolExecutor(max_workers=min(16, len(destinations)))
    try:
        plans = _gather([pool.submit(_ask, d[0], d[1], blobs, shipments) for d in destinations], destinations,
                        check_stop)
        problems = [_no_room(d[0], shipments, plan) for d, plan in zip(destinations, plans, strict=True)]
        if any(problems):
            raise ShipError([p for p in problems if p])
        reports = _gather([pool.submit(_send, *d, blobs, shipments, plan)
                           for d, plan in zip(destinations, plans, strict=True)], destinations, check_stop)
    except Exception:
        raise
    except BaseException:  # Ctrl-C or check_stop: end every upload now, not after its last byte
        for _, client in targets:
            client.close()
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    for r in reports:
        note(f"shipped to {', '.join(r.hosts)}: {_files(r.files_sent)}, {human_bytes(r.bytes_sent)} sent, "
             f"{human_bytes(r.bytes_present)} already there, {r.seconds:.1f} s")
    note(f"shipped {', '.join(f'{s.what} {s.local}' for s in shipments)} to {len(targets)} hosts: "
         f"{_files(sum(r.files_sent for r in reports))}, {human_bytes(sum(r.bytes_sent for r in reports))} "
         f"sent, {human_bytes(sum(r.bytes_present for r in reports))} already there, "
         f"{time.monotonic() - started:.1f} s")
    return reports


def _files(n: int) -> str:
    return f"{n} file" if n == 1 else f"{n} files"


@dataclass
class _Plan:
    token: str  # the host's incoming/<token> folder for this ship
    missing: list[str]
    free: int
    trees_ok: bool  # nothing missing and every tree built: nothing left to do
    started: float


def _gather(futures: list[Future[T]], destinations: list[_Destination],
            check_stop: Callable[[], None]) -> list[T]:
    """Every destination's result, or ShipError naming each host that failed."""
    out: list[T] = []
    problems: list[str] = []
    while wait(futures, timeout=POLL_SECONDS).not_done:
        check_stop()
    for (host, _, _), future in zip(destinations, futures, strict=True):
        try:
            out.append(future.result())
        except ShipError as exc:
            problems += exc.problems
        except (OSError, EOFError, paramiko.SSHException, ValueError, KeyError) as exc:
            problems.append(f"{host.name} ({host.label}): shipping failed: {type(exc).__name__}: {exc}")
    if problems:
        raise ShipError(problems)
    return out


@functools.cache
def _host_source() -> str:
    """blobstore.py's text: what each host runs (read once, when shipping first)."""
    return inspect.getsource(blobstore)


def _host_call(host: Host, client: paramiko.SSHClient, op: str, request: dict[str, Any], timeout: float,
               known: set[str]) -> dict[str, Any]:
    """Run :mod:`blobstore` on the host with ``request``; its answer, whose file lists
    may name only the files in ``known``."""
    request = {**request, "workdir": host.workdir}
    command = shell_line(HostPath(host.python), "-c", _host_source(), op)
    where = f"{host.name} ({host.label}): shipping into {host.workdir}"
    try:
        done = run(client, sh(command), timeout=timeout, stdin=json.dumps(request).encode(),
                   max_output=ANSWER_MAX_BYTES)
    except OutputTooLarge:
        raise ShipError([f"{where}: the host's answer is larger than {ANSWER_MAX_BYTES} bytes"]) from None
    if done.status != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise ShipError([f"{where} failed: {last}"])
    try:  # the host's answer is hostile input: its shape is checked before any of it is used
        answer = host_json(done.stdout)
        absent = [key for key in ANSWER_KEYS.get(op, ()) if key not in answer]
        if absent:
            raise ValueError(f"no {absent[0]!r}")
        for key in ("missing", "bad", "absent"):
            names = answer.get(key, [])
            if not isinstance(names, list) or not set(names) <= known:
                raise ValueError(f"{key!r} names files that were not asked about")
        if "free" in answer and (isinstance(answer["free"], bool) or not isinstance(answer["free"], int)):
            raise ValueError("'free' is not a whole number")
    except (ValueError, TypeError) as exc:
        raise ShipError([f"{where}: the host's answer is malformed ({exc})"]) from None
    return answer


def _trees(shipments: list[Shipment]) -> dict[str, list[list[str]]]:
    """What the host builds: {tree: [[path in the tree, sha256], ...]}."""
    return {s.tree: [[f.rel, f.sha256] for f in s.files] for s in shipments}


def _ask(host: Host, client: paramiko.SSHClient, blobs: dict[str, ShipFile], shipments: list[Shipment]
         ) -> _Plan:
    started = time.monotonic()
    request = {"blobs": {d: f.size for d, f in blobs.items()}, "trees": _trees(shipments)}
    answer = _host_call(host, client, "query", request,
                        QUERY_TIMEOUT + sum(f.size for f in blobs.values()) / HASH_RATE, set(blobs))
    return _Plan(secrets.token_hex(8), list(answer["missing"]), int(answer["free"]),
                 bool(answer["trees_ok"]), started)


def _no_room(host: Host, shipments: list[Shipment], plan: _Plan) -> str | None:
    """The one-line problem when ``host`` lacks room for what it is missing, else None."""
    if not plan.missing:
        return None
    sizes = {f.sha256: f.size for s in shipments for f in s.files}
    to_send = sum(sizes[d] for d in plan.missing)
    needed = to_send + PER_FILE_BYTES * len(plan.missing) + MARGIN_BYTES
    if needed <= plan.free:
        return None
    what = ", ".join(f"{s.what} {s.local}" for s in shipments)
    return (f"{host.name} ({host.label}): not enough space in {host.workdir} to ship {what}: needs "
            f"{human_bytes(needed)} ({human_bytes(to_send)} to send + {human_bytes(MARGIN_BYTES)} margin), "
            f"{human_bytes(plan.free)} free")


def _send(host: Host, client: paramiko.SSHClient, names: list[str], blobs: dict[str, ShipFile],
          shipments: list[Shipment], plan: _Plan) -> ShipReport:
    incoming = f"{host.workdir}/{blobstore.INCOMING}/{plan.token}"
    files = [blobs[d] for d in plan.missing]
    if files and has_sftp(client):
        _put_sftp(client, incoming, files)
    elif files and has_tar(client):
        _put_tar(client, incoming, files)
    elif files:
        raise ShipError([f"{host.name} ({host.label}): cannot ship: the host has neither an sftp server "
                         "nor tar"])
    answer: dict[str, list[str]] = {"bad": [], "absent": []}
    if not plan.trees_ok:
        answer = _host_call(host, client, "finish", {"token": plan.token, "trees": _trees(shipments)},
                            QUERY_TIMEOUT + sum(f.size for f in files) / HASH_RATE, set(blobs))
    if answer["bad"] or answer["absent"]:
        wrong = [blobs[d].local for d in answer["bad"] + answer["absent"]]
        raise ShipError([f"{host.name} ({host.label}): {len(wrong)} shipped files arrived with other "
                         f"bytes than were hashed here (changed while sending?), e.g. {wrong[0]}"])
    sent = sum(f.size for f in files)
    return ShipReport(names, len(files), sent, sum(f.size for f in blobs.values()) - sent,
                      time.monotonic() - plan.started)


def _put_sftp(client: paramiko.SSHClient, incoming: str, files: list[ShipFile]) -> None:
    with client.open_sftp() as sftp:
        sftp.get_channel().settimeout(STALL_TIMEOUT)
        sftp.mkdir(sftp_path(incoming))
        for f in files:
            with open(f.local, "rb") as source:
                sftp.putfo(source, f"{sftp_path(incoming)}/{f.sha256}", file_size=f.size, confirm=False)


def _put_tar(client: paramiko.SSHClient, incoming: str, files: list[ShipFile]) -> None:
    """One tar stream into ``tar -x`` on the host: no SFTP, no round trip per file."""
    transport = client.get_transport()
    if transport is None or not transport.is_active():
        raise ShipError(["SSH connection is closed"])
    channel = transport.open_session(timeout=QUERY_TIMEOUT)
    try:
        channel.settimeout(STALL_TIMEOUT)
        folder = HostPath(incoming)
        channel.exec_command(sh(shell_line("mkdir", folder, Shell("&&"), "tar", "-C", folder, "-xf", "-")))
        with channel.makefile("wb") as stream, tarfile.open(fileobj=stream, mode="w|") as archive:
            for f in files:
                archive.add(str(f.local), arcname=f.sha256, recursive=False)
        channel.shutdown_write()
        status = channel.recv_exit_status()
        if status != 0:
            error = channel.recv_stderr(4096).decode(errors="replace").strip()
            raise OSError(f"tar on the host exited with status {status}: {error}")
    finally:
        channel.close()
