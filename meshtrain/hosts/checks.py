"""``meshtrain hosts check``: is every host of an inventory ready to run a rank?

Per host, in parallel: SSH reachable and authenticated; the interpreter exists;
meshtrain and torch match the launching machine's versions; the device is there; the
workdir is writable; files can be copied (SFTP, or tar/cat over SSH where the sftp
subsystem is off); and the rendezvous port on rank 0 can be reached from every host
(a firewall on rank 0 is the usual culprit).
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import paramiko
import torch

import meshtrain
from meshtrain.hosts.host_output import host_json, visible
from meshtrain.hosts.inventory import Host, Inventory
from meshtrain.hosts.ssh import (
    ANSWER_LIMIT,
    HostPath,
    OutputTooLarge,
    RemoteProcess,
    Shell,
    SSHError,
    connect,
    run,
    sh,
    shell_line,
)
from meshtrain.hosts.transfer import has_sftp, has_tar

CHECKS = ("ssh", "python", "meshtrain", "torch", "device", "workdir", "sftp", "rendezvous")

#: A version (``3.11.7``, ``2.13.0+cpu``, ``0.1.0.dev3``) or a device (``cuda:0``) as a probe reports it.
VERSION_LIKE = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+:_-]{0,63}")

# Run on each host by its interpreter: versions, device and workdir, as one JSON line
# (its answer, like every question's, is at most ANSWER_LIMIT bytes).
PROBE = r"""
import json, os, sys, tempfile
out = {"python": sys.version.split()[0]}
try:
    import meshtrain
    out["meshtrain"] = meshtrain.__version__
except Exception as e:
    out["meshtrain_error"] = f"{type(e).__name__}: {e}"
try:
    import torch
    out["torch"] = torch.__version__
    want = sys.argv[1]
    cuda, mps = torch.cuda.is_available(), torch.backends.mps.is_available()
    found = "cuda" if cuda else "mps" if mps else "cpu"
    kind = want.split(":")[0]
    ok = kind in ("auto", "cpu") or (kind == "cuda" and cuda) or (kind == "mps" and mps)
    out["device"] = found if kind == "auto" else want
    out["device_ok"] = ok
except Exception as e:
    out["torch_error"] = f"{type(e).__name__}: {e}"
try:
    wd = os.path.expanduser(sys.argv[2])
    os.makedirs(wd, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=wd, prefix=".meshtrain-check-"):
        pass
    out["workdir"] = wd
except Exception as e:
    out["workdir_error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""

# Run on rank 0: listen on the rendezvous port until the launcher closes the session.
LISTENER = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("", int(sys.argv[1])))
except OSError as e:
    print("BIND-FAILED", e, flush=True)
    sys.exit(3)
s.listen(64)
print("LISTENING", flush=True)
s.settimeout(1.0)
while True:
    try:
        s.accept()[0].close()
    except socket.timeout:
        pass
"""

# Run on every host: open a TCP connection to rank 0's rendezvous address.
CONNECTOR = r"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("CONNECTED")
except OSError as e:
    print("FAILED", e)
"""


@dataclass
class Check:
    """One cell of the table: passed or not, a short detail, and the fix if it failed."""

    ok: bool | None  # None: not run because an earlier check failed
    detail: str = ""
    fix: str = ""


@dataclass
class HostReport:
    """All checks of one host."""

    host: Host
    checks: dict[str, Check] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.ok is not False for c in self.checks.values())


def check_hosts(inventory: Inventory, *, accept_new_host_keys: bool = False,
                timeout: float = 10.0) -> list[HostReport]:
    """Run every check on every host (in parallel) and return one report per host."""
    reports = [HostReport(h, {name: Check(None) for name in CHECKS}) for h in inventory.hosts]
    clients: list[paramiko.SSHClient | None] = [None] * inventory.world_size

    def probe(report: HostReport) -> None:
        try:
            client = connect(report.host, accept_new_host_keys=accept_new_host_keys, timeout=timeout)
        except SSHError as exc:
            message = str(exc).split(": ", 1)[1]
            report.checks["ssh"] = Check(False, "failed", message)
            return
        clients[report.host.rank] = client
        report.checks["ssh"] = Check(True, "ok")
        python = report.host.python
        try:
            report.checks["sftp"] = _transfer_check(client)
            _probe_host(client, report, timeout)
        except OutputTooLarge:
            report.checks["python"] = Check(False, "broken", f"{python}: the host answered with more than "
                                                             f"{ANSWER_LIMIT} bytes")
        except (OSError, EOFError, paramiko.SSHException) as exc:  # the host went away mid-check
            why = visible(str(exc)) or type(exc).__name__
            report.checks["python"] = Check(False, "failed", f"{python}: the connection failed during the "
                                                             f"check ({why})")

    try:
        with ThreadPoolExecutor(max_workers=min(16, inventory.world_size)) as pool:
            list(pool.map(probe, reports))
        _check_rendezvous(inventory, reports, clients, timeout)
    finally:
        for c in clients:
            if c is not None:
                c.close()
    return reports


def _probe_host(client: paramiko.SSHClient, report: HostReport, timeout: float) -> None:
    host = report.host
    py = HostPath(host.python)
    result = run(client, sh(shell_line("test", "-x", py, Shell("|| exit 41;"), "exec", py, "-c", PROBE,
                                       host.device, host.workdir)),
                 timeout=max(60.0, timeout))
    if result.status == 41:
        report.checks["python"] = Check(False, "not found", f"{host.python} is not an executable on "
                                        "the host: set 'python' to the absolute path (`which python3` there)")
        return
    try:  # a host's answer is checked before it is used
        info = host_json(result.stdout.strip().splitlines()[-1])
        if not isinstance(info.get("python"), str):
            raise ValueError("no 'python'")
        for key in ("python", "meshtrain", "torch", "device"):  # versions and a device name
            if key in info and not (isinstance(info[key], str) and VERSION_LIKE.fullmatch(info[key])):
                raise ValueError(f"{key!r} is not a version")
        for key in ("workdir", "meshtrain_error", "torch_error", "workdir_error"):  # free text, shown
            if not isinstance(info.get(key, ""), str):
                raise ValueError(f"{key!r} is not text")
            if key in info:
                info[key] = visible(info[key])
        if "device_ok" in info and (not isinstance(info["device_ok"], bool) or "device" not in info):
            raise ValueError("'device_ok' without a device")
    except (ValueError, IndexError):
        error = visible((result.stderr.strip().splitlines() or ["no output"])[-1])
        report.checks["python"] = Check(False, "broken", f"{host.python} failed: {error}")
        return
    report.checks["python"] = Check(True, info["python"])
    report.checks["meshtrain"] = _version_check(
        "meshtrain", info.get("meshtrain"), meshtrain.__version__, info.get("meshtrain_error"), host)
    report.checks["torch"] = _version_check(
        "torch", info.get("torch"), torch.__version__, info.get("torch_error"), host)
    if "device_ok" in info:
        report.checks["device"] = (
            Check(True, info["device"]) if info["device_ok"] else
            Check(False, f"no {host.device}", f"torch on the host sees no {host.device}: set 'device: auto' "
                  "or install a torch build with that backend")
        )
    if "workdir" in info:
        report.checks["workdir"] = Check(True, "writable")
    else:
        report.checks["workdir"] = Check(False, "not writable", f"cannot write in {host.workdir} "
                                         f"({info.get('workdir_error')}): pick a folder the user owns")


def _transfer_check(client: paramiko.SSHClient) -> Check:
    """SFTP, or the tar/cat fallback the launcher uses without it (transfer.py)."""
    if has_sftp(client):
        return Check(True, "available")
    if has_tar(client):
        return Check(True, "unavailable, tar fallback used")
    return Check(False, "unavailable, no tar", "the host has no sftp server and no tar: enable "
                 "'Subsystem sftp' in its sshd_config, or install tar")


def _version_check(name: str, theirs: str | None, ours: str, error: str | None, host: Host) -> Check:
    if theirs is None:
        return Check(False, "missing", f"{name} does not import with {host.python} ({error}): "
                                       f"`{host.python} -m pip install {name}` on the host")
    if theirs != ours:
        return Check(False, theirs, f"{name} {theirs} on the host but {ours} here: install the same "
                                    "version on every machine (results and protocol must match)")
    return Check(True, theirs)


def _check_rendezvous(inventory: Inventory, reports: list[HostReport],
                      clients: list[paramiko.SSHClient | None], timeout: float) -> None:
    """Listen on rank 0's rendezvous port; every host that has SSH tries to connect to it."""
    master, port = inventory.master, inventory.rendezvous.port
    addr = f"{master.advertise}:{port}"
    rank0 = clients[0]
    if rank0 is None or reports[0].checks["python"].ok is not True:
        return  # nothing can listen there: the earlier failure says why
    lines: list[str] = []
    listener = RemoteProcess(rank0, shell_line(HostPath(master.python), "-c", LISTENER, str(port)),
                             lines.append)
    try:
        deadline = time.monotonic() + timeout + 30.0
        while not any(x.startswith(("LISTENING", "BIND-FAILED")) for x in lines):
            if listener.finished or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not any(x.startswith("LISTENING") for x in lines):
            why = next((x for x in lines if x.startswith("BIND-FAILED")), "listener did not start")
            reports[0].checks["rendezvous"] = Check(
                False, "port busy", f"cannot listen on port {port} on {master.name} ({why[12:] or why}): "
                "another run or program holds it; stop it or change rendezvous.port")
            return

        def connect_from(report: HostReport) -> None:
            client = clients[report.host.rank]
            if client is None or report.checks["python"].ok is not True:
                return
            connector = shell_line(HostPath(report.host.python), "-c", CONNECTOR, master.advertise,
                                   str(port), "5")
            out = run(client, sh(connector), timeout=30.0).stdout.strip()
            if out.startswith("CONNECTED"):
                report.checks["rendezvous"] = Check(True, "reached")
            else:
                report.checks["rendezvous"] = Check(
                    False, "blocked", f"cannot connect to {addr} ({out[7:] or 'no answer'}): check "
                    f"'advertise' of {master.name}, and allow incoming port {port} in its firewall "
                    "(macOS: System Settings > Network > Firewall, allow the python binary)")

        with ThreadPoolExecutor(max_workers=min(16, len(reports))) as pool:
            list(pool.map(connect_from, reports))
    finally:
        listener.interrupt()
        listener.close()
