"""``meshtrain hosts add``: a host joins a running ``launch --elastic``.

While an elastic launch runs, its launcher keeps a control folder in the local run
directory, ``<out>/<run-id>/launch/``:

* ``launcher.json``: the launcher's process id and whether it still runs;
* ``hosts.yaml``: the inventory of record: the inventory the run was launched with, plus
  every host added since, in rank order (a host's rank is its place in this list);
* ``requests/``: one file per host asked for, written atomically by ``hosts add``.

``hosts add`` checks the new entry as part of the inventory of record (the inventory's own
parser: the same one-line errors, a name or a machine already in the run refused) and
drops a request. The launcher looks for requests in its loop, checks the host over SSH as
at launch (host key, interpreter, workdir, the data shipped), appends it to the record,
asks rank 0 through the rendezvous store to make it the next slot (:mod:`meshtrain.comm.membership`),
and starts its rank as a joiner. When the run directory comes back from rank 0's host at
the end, the control folder is kept in it.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from meshtrain import yaml12
from meshtrain.errors import InputError
from meshtrain.hosts.inventory import HOST_ONLY_KEYS, SHARED_KEYS, Host, Inventory, parse_inventory
from meshtrain.run_dir import atomic_write_text

#: The launcher's control folder inside the local run directory.
CONTROL = "launch"
LAUNCHER_FILE = "launcher.json"
RECORD_FILE = "hosts.yaml"
REQUESTS = "requests"
TAKEN = "taken"  # under requests/: the requests the launcher is bringing in
#: A request file larger than this is not a host entry (refused unread).
MAX_REQUEST_BYTES = 64 << 10
#: How often the launcher looks for requests.
POLL_S = 0.5


class AddHostError(InputError):
    """``hosts add`` cannot ask for this host: one line naming the run directory or the key."""


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


@dataclass
class RunControl:
    """The control folder of one elastic launch (see the module docstring)."""

    folder: Path

    @property
    def record(self) -> Path:
        return self.folder / RECORD_FILE

    @property
    def requests(self) -> Path:
        return self.folder / REQUESTS

    # ----------------------------------------------------------------- the launcher's side
    @classmethod
    def claim(cls, run_dir: Path, run_id: str, inventory: Inventory) -> RunControl | None:
        """Make ``run_dir/launch/`` for this launch; None when ``run_dir`` exists already (a
        run id used before: hosts cannot be added to this launch, and the run directory is
        not copied over it at the end either)."""
        try:
            run_dir.mkdir(parents=True)
        except FileExistsError:
            return None
        control = cls(run_dir / CONTROL)
        control.requests.mkdir(parents=True)
        try:
            raw = yaml12.read(inventory.path) if inventory.path.is_file() else None
        except (OSError, yaml.YAMLError):
            raw = None  # the file changed since it was read: the hosts as they run
        if not isinstance(raw, dict) or not isinstance(raw.get("hosts"), list) \
                or len(raw["hosts"]) != len(inventory.hosts):  # a Python caller's inventory, say
            raw = {"hosts": [_entry_of(h) for h in inventory.hosts]}
        raw["rendezvous"] = {"port": inventory.rendezvous.port, "timeout": inventory.rendezvous.timeout,
                             "heartbeat_timeout": inventory.rendezvous.heartbeat_timeout}
        # What every host of the launch runs with (launch's --device and --threads included) is
        # an added host's default too: a host left on all its cores beside ranks held to one
        # thread each would be the run's straggler.
        defaults = dict(raw.get("defaults") or {})
        for key in ("device", "threads"):
            shared = {getattr(h, key) for h in inventory.hosts}
            if len(shared) == 1 and None not in shared:
                defaults[key] = shared.pop()
        raw["defaults"] = defaults
        atomic_write_text(control.record, yaml.safe_dump(raw, sort_keys=False))
        control._write_state(running=True, run_id=run_id)
        return control

    def _write_state(self, *, running: bool, run_id: str) -> None:
        atomic_write_text(self.folder / LAUNCHER_FILE, json.dumps(
            {"pid": os.getpid(), "run_id": run_id, "elastic": True, "running": running}) + "\n")

    def finished(self, run_id: str) -> None:
        """The launch is over: no more hosts may be asked for (requests left are removed).
        A control folder someone removed meanwhile is left removed."""
        try:
            self._write_state(running=False, run_id=run_id)
            for left in [*self.requests.glob("*.yaml"), *self.requests.glob(f"{TAKEN}/*.yaml")]:
                left.unlink(missing_ok=True)
        except OSError:
            pass

    def take_requests(self) -> list[tuple[str, dict[str, Any]]]:
        """The requests written since the last look, oldest first, each moved to
        ``requests/taken/`` until :meth:`done`: (file name, host entry). A file that is not
        an entry is taken as ``{}`` (refused later with its reason)."""
        taken = []
        for path in sorted(self.requests.glob("*.yaml")):
            try:
                text = path.read_text() if path.stat().st_size <= MAX_REQUEST_BYTES else ""
                entry = yaml12.load(text)
            except (OSError, yaml.YAMLError, UnicodeDecodeError):
                entry = {}
            try:
                (self.requests / TAKEN).mkdir(exist_ok=True)
                os.replace(path, self.requests / TAKEN / path.name)
            except OSError:  # removed meanwhile (the folder with it): nothing to take
                continue
            taken.append((path.name, entry if isinstance(entry, dict) else {}))
        return taken

    def done(self, name: str) -> None:
        """The request ``name`` is settled: its host is in the record, or was refused."""
        (self.requests / TAKEN / name).unlink(missing_ok=True)

    def host_for(self, entry: dict[str, Any]) -> Host:
        """``entry`` as the next host of the record (its rank the next slot), checked by the
        inventory's parser; raises :class:`~meshtrain.hosts.inventory.InventoryError` or
        :class:`AddHostError` naming the fault."""
        raw = self._record_raw()
        return _checked(raw, entry, self.record)

    def append(self, entry: dict[str, Any]) -> None:
        """Add ``entry`` to the inventory of record (the launcher, once the host is in)."""
        raw = self._record_raw()
        raw["hosts"] = [*raw["hosts"], entry]
        atomic_write_text(self.record, yaml.safe_dump(raw, sort_keys=False))

    def _record_raw(self) -> dict[str, Any]:
        try:
            raw = yaml12.read(self.record)
        except (OSError, yaml.YAMLError) as exc:
            raise AddHostError(f"{self.record}: cannot read the run's inventory of record ({exc})") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("hosts"), list):
            raise AddHostError(f"{self.record}: not an inventory (no list of hosts)")
        return raw

    # ----------------------------------------------------------------- hosts add's side
    @classmethod
    def of_running(cls, run_dir: Path) -> RunControl:
        """The control folder of the elastic launch running into ``run_dir``, or
        :class:`AddHostError` saying why ``run_dir`` is not one."""
        state_file = run_dir / CONTROL / LAUNCHER_FILE
        if not run_dir.is_dir():
            raise AddHostError(f"{run_dir}: no such run directory (give the <out>/<run-id> folder of a "
                               "running `meshtrain launch --elastic`)")
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError):
            raise AddHostError(f"{run_dir}: not the run directory of a running `meshtrain launch --elastic` "
                               f"(no {CONTROL}/{LAUNCHER_FILE}: hosts can be added to elastic launches "
                               "only)") from None
        pid = state.get("pid") if isinstance(state, dict) else None
        if not isinstance(pid, int) or not state.get("running") or not _process_alive(pid):
            raise AddHostError(f"{run_dir}: its launch has ended; hosts can be added only while it runs")
        return cls(run_dir / CONTROL)

    def request(self, entry: dict[str, Any]) -> Host:
        """Check ``entry`` against the record and the requests not yet taken, and leave a
        request for the launcher (written atomically). Returns the host as it will run."""
        raw = self._record_raw()
        # Asked for before, and not in the record yet: they come first.
        known = {e.get("name") for e in raw["hosts"] if isinstance(e, dict)}
        pending = [e for _, e in _peek(self.requests / TAKEN) + _peek(self.requests)
                   if e.get("name") not in known]
        raw["hosts"] = [*raw["hosts"], *pending]
        host = _checked(raw, entry, self.record)
        name = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}.yaml"
        atomic_write_text(self.requests / name, yaml.safe_dump(entry, sort_keys=False))
        return host


def _peek(folder: Path) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(folder.glob("*.yaml")):
        try:
            entry = yaml12.load(path.read_text())
        except (OSError, yaml.YAMLError, UnicodeDecodeError):
            continue
        if isinstance(entry, dict):
            found.append((path.name, entry))
    return found


def _checked(raw: dict[str, Any], entry: dict[str, Any], record: Path) -> Host:
    """``entry`` parsed as the last host of ``raw``'s inventory; a machine already in it
    (the same user, address and port) is refused like a duplicate name."""
    inventory = parse_inventory({**raw, "hosts": [*raw["hosts"], entry]}, record)
    new = inventory.hosts[-1]
    for host in inventory.hosts[:-1]:
        if (host.user, host.hostname, host.port, host.workdir) == (new.user, new.hostname, new.port,
                                                                   new.workdir):
            raise AddHostError(f"{record}: host {new.name!r}: {new.label} (workdir {new.workdir}) is "
                               f"already in the run as {host.name!r}")
    return new


def entry_from_words(words: list[str]) -> dict[str, Any]:
    """A host entry from ``KEY=VALUE`` words (``name=box3 host=10.0.0.3 threads=4``); each
    value is read as YAML (``threads=4`` a number, ``env={A: b}`` a mapping)."""
    allowed = HOST_ONLY_KEYS + SHARED_KEYS
    entry: dict[str, Any] = {}
    for word in words:
        key, sep, text = word.partition("=")
        if not sep or not key:
            raise AddHostError(f"hosts add: {word!r} is not KEY=VALUE (keys: {', '.join(allowed)})")
        try:
            value = yaml12.load(text) if text else ""
        except yaml.YAMLError as exc:
            raise AddHostError(f"hosts add: {key}: {yaml12.problem(exc)}") from None
        if key in entry:
            raise AddHostError(f"hosts add: {key} is given twice")
        entry[key] = text if value is None else value
    return entry


def _entry_of(host: Host) -> dict[str, Any]:
    """An inventory entry that parses back to ``host`` (rank from its place)."""
    entry: dict[str, Any] = {"name": host.name, "host": host.host, "advertise": host.advertise,
                             "user": host.user, "port": host.port, "known_hosts": host.known_hosts,
                             "python": host.python, "workdir": host.workdir, "device": host.device}
    optional = {"identity_file": host.identity_file, "iface": host.iface, "threads": host.threads,
                "env": host.env or None}
    entry.update({k: v for k, v in optional.items() if v is not None})
    return entry


def only_control(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds nothing but a launch's control folder (no run came back yet)."""
    try:
        return [p.name for p in run_dir.iterdir()] == [CONTROL]
    except OSError:
        return False


def drop_if_only_control(run_dir: Path) -> None:
    """After a launch whose run directory never came back: no run directory is left (as a
    failed run leaves none), only what the launcher said."""
    if only_control(run_dir):
        shutil.rmtree(run_dir, ignore_errors=True)


def keep_control(run_dir: Path, fetched: Path) -> None:
    """The run directory came back into ``fetched`` beside ``run_dir`` (which holds the
    control folder): the control folder moves into it, and it takes ``run_dir``'s place.
    Rank 0's host never writes a control folder: one it sent is not kept."""
    theirs = fetched / CONTROL
    if theirs.exists() or theirs.is_symlink():
        shutil.rmtree(theirs) if theirs.is_dir() and not theirs.is_symlink() else theirs.unlink()
    os.replace(run_dir / CONTROL, theirs)
    os.rmdir(run_dir)
    os.replace(fetched, run_dir)


def launcher_address(target: str, port: int) -> str | None:
    """The address this machine reaches ``target`` from: what rank 0's gate sees of the
    launcher when it passes the gate to add a host (no packet is sent to find it)."""
    try:
        family, _, _, _, where = socket.getaddrinfo(target, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(where)
            return str(probe.getsockname()[0])
    except (OSError, IndexError):
        return None


class HostAdder:
    """The launcher's side of ``hosts add``: takes the requests from the control folder
    (:meth:`poll`, from the launch loop) and brings each host in, one at a time, on a
    thread of its own, so the loop goes on watching the ranks.

    ``prepare(host)`` checks the host over SSH as at launch and readies it (data, uploads,
    the secret), returning the connection; ``tell(host)`` has rank 0 make it the next slot;
    ``start(host, client)`` starts its rank as a joiner. The launcher gives all three."""

    def __init__(self, control: RunControl, prepare: Callable[[Host], Any], tell: Callable[[Host], None],
                 start: Callable[[Host, Any], None], note: Callable[[str], None]) -> None:
        self.control = control
        self.prepare = prepare
        self.tell = tell
        self.start = start
        self.note = note
        self.added: list[Host] = []
        self._queue: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue()
        self._next_look = 0.0
        self._thread: threading.Thread | None = None

    def poll(self) -> None:
        """Look for new requests (at most every :data:`POLL_S`)."""
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + POLL_S
        for request in self.control.take_requests():
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, daemon=True, name="meshtrain-add-host")
                self._thread.start()
            self._queue.put(request)

    def stop(self) -> None:
        """The run is over: no more hosts (one being added ends after its current step)."""
        self._queue.put(None)

    def _work(self) -> None:
        while (request := self._queue.get()) is not None:
            try:
                self._add(*request)
            except Exception as exc:  # noqa: BLE001 - this thread must go on taking requests
                self.note(f"cannot add the host of {REQUESTS}/{request[0]}: {type(exc).__name__}: {exc}")
            finally:
                self.control.done(request[0])

    def _add(self, name: str, entry: dict[str, Any]) -> None:
        try:
            host = self.control.host_for(entry)
        except InputError as exc:
            self.note(f"cannot add a host ({REQUESTS}/{name}): {exc}")
            return
        self.note(f"adding host {host.name} ({host.label}) as rank {host.rank}: checking it over SSH")
        try:
            client = self.prepare(host)
        except Exception as exc:  # noqa: BLE001 - said, and the run goes on without it
            self.note(f"cannot add host {host.name}: {exc}")
            return
        try:
            self.tell(host)
        except Exception as exc:  # noqa: BLE001 - rank 0 never took it: nothing to undo there
            client.close()
            self.note(f"cannot add host {host.name}: {exc}")
            return
        self.control.append(entry)
        self.added.append(host)
        self.note(f"host {host.name} is rank {host.rank}: started to join at the next sync")
        self.start(host, client)
