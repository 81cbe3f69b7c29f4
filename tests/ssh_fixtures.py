"""Real OpenSSH servers for the launcher tests: on loopback, or one per network namespace.

Every sshd started here has its own generated host key, accepts only a generated user
key (no passwords, no PAM), writes its own PidFile, and is stopped by that pid. Hosts
in namespaces get 10.200.0.x addresses that exist only inside the namespaces; the
launcher then runs in a client namespace (``ip netns exec``), never the root one.
Where sshd or namespaces cannot be had, the tests skip and say why.
"""

from __future__ import annotations

import codecs
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from in_process import meshtrain_here

SSHD = "/usr/sbin/sshd"
PYTHON = sys.executable
SUBNET = "10.200.0"


def _need(tool: str) -> str:
    path = shutil.which(tool) or (tool if os.path.exists(tool) else None)
    if path is None:
        pytest.skip(f"{tool} is not installed (apt-get install openssh-server openssh-client)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate_key(path: Path) -> Path:
    """A passphrase-less ed25519 key pair at ``path`` and ``path.pub``."""
    subprocess.run([_need("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-C", "meshtrain-test",
                    "-f", str(path)], check=True)
    return path


@dataclass
class Sshd:
    """One running sshd."""

    address: str
    port: int
    host_key: Path  # private; the .pub beside it goes into known_hosts
    pid: int
    log: Path
    netns: str | None = None

    def known_hosts_line(self) -> str:
        name = self.address if self.port == 22 else f"[{self.address}]:{self.port}"
        kind, blob = self.host_key.with_suffix(".pub").read_text().split()[:2]
        return f"{name} {kind} {blob}\n"

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _alive(self.pid):
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie sshd (our child, reaped later) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def start_sshd(folder: Path, authorized_key: Path, *, address: str = "127.0.0.1", port: int | None = None,
               netns: str | None = None, wrap: tuple[str, ...] = (), extra_config: str = "",
               session_env: dict[str, str] | None = None) -> Sshd:
    """Start sshd on ``address:port`` (inside ``netns`` if given) and wait until it listens.

    ``wrap`` goes before the command (e.g. ``unshare -m ...``: a mount only it sees);
    ``extra_config`` is appended to its sshd_config; ``session_env`` is set in every session
    (sshd takes one ``SetEnv`` line, its first)."""
    _need(SSHD)
    folder.mkdir(parents=True, exist_ok=True)
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # its privilege-separation folder
    port = port or free_port()
    host_key = folder / "host_ed25519"
    if not host_key.exists():
        generate_key(host_key)
    pid_file, log = folder / "sshd.pid", folder / "sshd.log"
    pid_file.unlink(missing_ok=True)
    config = folder / "sshd_config"
    config.write_text(
        f"ListenAddress {address}\nPort {port}\nHostKey {host_key}\nPidFile {pid_file}\n"
        f"AuthorizedKeysFile {authorized_key}\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPubkeyAuthentication yes\n"
        "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\nUseDNS no\n"
        "ClientAliveInterval 5\nClientAliveCountMax 3\nMaxSessions 32\nMaxStartups 64\n"
        "Subsystem sftp internal-sftp\nLogLevel VERBOSE\n"
        # bash, started by sshd for a command, reads ~/.bashrc only as the first shell; given
        # SHLVL=1 it counts itself the second and does not, so the hosts' logins are the
        # system's, not this machine's root's. (That .bashrc runs `pyenv rehash`, whose lock
        # races between two logins at once and prints "pyenv: cannot rehash" into a rank's output.)
        "SetEnv " + " ".join(f"{k}={v}" for k, v in {"SHLVL": "1", **(session_env or {})}.items()) + "\n"
        + extra_config
    )
    command = [SSHD, "-f", str(config), "-E", str(log)]
    if netns:
        command = ["ip", "netns", "exec", netns, *command]
    command = [*wrap, *command]
    subprocess.run(command, check=True, timeout=20)  # sshd forks into the background itself
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if pid_file.exists() and pid_file.read_text().strip() and "Server listening" in _read(log):
            return Sshd(address, port, host_key, int(pid_file.read_text()), log, netns)
        time.sleep(0.05)
    raise RuntimeError(f"sshd did not start: {_read(log)[-2000:]}")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


@dataclass
class SshWorld:
    """A user key, a known_hosts file and the servers the tests log in to."""

    folder: Path
    user_key: Path
    known_hosts: Path
    servers: list[Sshd] = field(default_factory=list)
    client_netns: str | None = None  # where the launcher must run (None: root namespace)

    def trust(self, server: Sshd) -> None:
        with open(self.known_hosts, "a") as f:
            f.write(server.known_hosts_line())

    def inventory(self, path: Path, hosts: list[dict[str, Any]], **defaults: Any) -> Path:
        """Write an inventory whose defaults point at this world's key and known_hosts."""
        base = {"user": "root", "identity_file": str(self.user_key), "known_hosts": str(self.known_hosts),
                "ssh_config": str(self.folder / "ssh_config"), "python": PYTHON, "device": "cpu"}
        rendezvous = defaults.pop("rendezvous", {"port": free_port(), "timeout": 60})
        base.update(defaults)
        path.write_text(yaml.safe_dump({"defaults": base, "rendezvous": rendezvous, "hosts": hosts},
                                       sort_keys=False))
        return path

    def command(self, *args: str) -> list[str]:
        """A command line run where the launcher belongs (the client namespace, if any)."""
        prefix = ["ip", "netns", "exec", self.client_netns] if self.client_netns else []
        return [*prefix, *args]


def new_world(folder: Path) -> SshWorld:
    folder.mkdir(parents=True, exist_ok=True)
    user_key = generate_key(folder / "user_ed25519")
    (folder / "ssh_config").write_text("")  # so the user's own ~/.ssh/config plays no part
    known = folder / "known_hosts"
    known.write_text("")
    return SshWorld(folder, user_key, known)


def loopback_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshWorld]:
    """One sshd on 127.0.0.1 at a free port, its host key trusted (``yield from`` it in a fixture)."""
    if os.geteuid() != 0:
        pytest.skip("the test sshd logs in as root with a generated key; run the tests as root")
    world = new_world(tmp_path_factory.mktemp("ssh"))
    server = start_sshd(world.folder / "sshd", world.user_key.with_suffix(".pub"))
    world.servers.append(server)
    world.trust(server)
    try:
        yield world
    finally:
        server.stop()


# --------------------------------------------------------------------------- namespaces
def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@dataclass
class Namespaces:
    """A bridge namespace joining host namespaces and a client namespace on 10.200.0.0/24."""

    bridge: str
    client: str
    hosts: list[str]
    addresses: dict[str, str]

    def all(self) -> list[str]:
        return [self.bridge, self.client, *self.hosts]

    def delete(self) -> None:
        for ns in self.all():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)

    def set_link(self, ns: str, up: bool) -> None:
        """Plug or unplug a namespace's cable (its eth0)."""
        _ip("-n", ns, "link", "set", "eth0", "up" if up else "down")


def make_namespaces(n_hosts: int) -> Namespaces:
    """Create the namespaces, or skip the test saying why that is impossible here."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_NET_ADMIN)")
    tag = uuid.uuid4().hex[:6]
    ns = Namespaces(f"mt-{tag}-br", f"mt-{tag}-client", [f"mt-{tag}-h{i}" for i in range(n_hosts)], {})
    try:
        _ip("netns", "add", ns.bridge)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode().strip()}")
    try:
        _ip("-n", ns.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", ns.bridge, "link", "set", "br0", "up")
        members = [(ns.client, f"{SUBNET}.2")] + [(h, f"{SUBNET}.{10 + i}") for i, h in enumerate(ns.hosts)]
        for i, (name, address) in enumerate(members):
            _ip("netns", "add", name)
            _ip("-n", ns.bridge, "link", "add", f"p{i}", "type", "veth",
                "peer", "name", "eth0", "netns", name)
            _ip("-n", ns.bridge, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
            ns.addresses[name] = address
    except BaseException:
        ns.delete()
        raise
    return ns


def netns_world(tmp_path_factory: pytest.TempPathFactory,
                n_hosts: int = 2) -> Iterator[tuple[SshWorld, Namespaces]]:
    """``n_hosts`` hosts, each a namespace with its own sshd and address, and the launcher's
    namespace (``yield from`` it in a fixture)."""
    ns = make_namespaces(n_hosts)
    world = new_world(tmp_path_factory.mktemp("netns-ssh"))
    world.client_netns = ns.client
    try:
        for i, host_ns in enumerate(ns.hosts):
            server = start_sshd(world.folder / f"sshd-{i}", world.user_key.with_suffix(".pub"),
                                address=ns.addresses[host_ns], port=22, netns=host_ns)
            world.servers.append(server)
            world.trust(server)
        _wait_reachable(world, ns)
        yield world, ns
    finally:
        for server in world.servers:
            server.stop()
        ns.delete()


def _wait_reachable(world: SshWorld, ns: Namespaces) -> None:
    """From the client namespace, every sshd answers (bridges take a moment to forward)."""
    probe = ("import socket,sys,time\n"
             "for a in sys.argv[1:]:\n"
             "    end=time.time()+10\n"
             "    while True:\n"
             "        try: socket.create_connection((a,22),timeout=1).close(); break\n"
             "        except OSError:\n"
             "            if time.time()>end: sys.exit(f'{a} unreachable')\n"
             "            time.sleep(0.1)\n")
    subprocess.run(world.command(PYTHON, "-c", probe, *[s.address for s in world.servers]),
                   check=True, timeout=30)


# --------------------------------------------------------------------------- mDNS
# Runs inside a host namespace: announce one SSH service (as a Mac with Remote Login does)
# until stdin closes.
ADVERTISE = """
import socket, sys
from zeroconf import ServiceInfo, Zeroconf
service, server, address = sys.argv[1:4]
zc = Zeroconf()
info = ServiceInfo("_ssh._tcp.local.", f"{service}._ssh._tcp.local.", port=22, server=server,
                   addresses=[socket.inet_aton(address)])
zc.register_service(info)
print("registered", flush=True)
sys.stdin.read()
zc.unregister_service(info)
zc.close()
"""


def start_advertising(netns: str, service: str, server: str, address: str) -> subprocess.Popen[str]:
    """Announce ``_ssh._tcp`` as ``service`` (mDNS host ``server``) from ``netns``; returns once
    registered. Stop it with ``kill()`` and ``wait()``."""
    proc = subprocess.Popen(["ip", "netns", "exec", netns, PYTHON, "-c", ADVERTISE, service, server, address],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "registered"
    return proc


#: Runs in a host namespace: raw mDNS answers every 0.2 s until killed, as any program on the
#: LAN can send them. argv: mode, count, addresses (comma-separated, used in turn).
#: "claim": an address record for studio-1.local. (the honest host 0's name) with the rogue's
#: address, cache-flush bit set; "silent": ``count`` services that are only named, never
#: resolvable; "many": ``count`` resolvable services rogue-N on host rogue-N.local.
ROGUE = """
import socket, sys, time
from zeroconf import DNSAddress, DNSOutgoing, DNSPointer, DNSService, DNSText, const
mode, count, addresses = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
unique = const._CLASS_IN | const._CLASS_UNIQUE
out = DNSOutgoing(const._FLAGS_QR_RESPONSE | const._FLAGS_AA)
if mode == "claim":
    out.add_answer_at_time(DNSAddress("studio-1.local.", const._TYPE_A, unique, 120,
                                      socket.inet_aton(addresses[0])), 0)
for i in range(count if mode != "claim" else 0):
    full, server = f"rogue-{i}._ssh._tcp.local.", f"rogue-{i}.local."
    out.add_answer_at_time(DNSPointer("_ssh._tcp.local.", const._TYPE_PTR, const._CLASS_IN, 120, full), 0)
    if mode == "many":
        out.add_answer_at_time(DNSService(full, const._TYPE_SRV, unique, 120, 0, 0, 22, server), 0)
        out.add_answer_at_time(DNSText(full, const._TYPE_TXT, unique, 120, b"\\x00"), 0)
        address = socket.inet_aton(addresses[i % len(addresses)])
        out.add_answer_at_time(DNSAddress(server, const._TYPE_A, unique, 120, address), 0)
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(sys.argv[4]))
print("sending", flush=True)
while True:
    for packet in out.packets():
        sock.sendto(packet, ("224.0.0.251", 5353))
    time.sleep(0.2)
"""


@contextmanager
def rate_limited(ns: Namespaces, rate: str, burst: str = "32kb", latency: str = "50ms") -> Iterator[None]:
    """While inside, every host of ``ns`` sends at most ``rate`` through its eth0 (``tc tbf``);
    the limits are removed afterwards. Skips the test where tc is missing or cannot shape."""
    if shutil.which("tc") is None:
        pytest.skip("tc (iproute2) is not installed")
    limited: list[str] = []
    try:
        for host in ns.hosts:
            done = subprocess.run(["tc", "-n", host, "qdisc", "add", "dev", "eth0", "root", "tbf",
                                   "rate", rate, "burst", burst, "latency", latency],
                                  capture_output=True, text=True, timeout=20)
            if done.returncode != 0:
                pytest.skip(f"cannot rate-limit a namespace link with tc tbf: {done.stderr.strip()}")
            limited.append(host)
        yield
    finally:
        for host in limited:
            subprocess.run(["tc", "-n", host, "qdisc", "del", "dev", "eth0", "root"], check=True,
                           capture_output=True, timeout=20)


@contextmanager
def rogue_announcing(netns: str, mode: str, count: int, addresses: list[str], source: str) -> Iterator[None]:
    """While inside, :data:`ROGUE`'s ``mode`` answers are sent from ``netns`` (its interface
    address ``source``): a rogue on the LAN."""
    proc = subprocess.Popen(["ip", "netns", "exec", netns, PYTHON, "-c", ROGUE, mode, str(count),
                             ",".join(addresses), source], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "sending"
        yield
    finally:
        proc.kill()
        proc.wait(timeout=10)


# --------------------------------------------------------------------------- processes
def processes_with(marker: str) -> list[str]:
    """``ps`` lines of live processes whose command line contains ``marker``."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,stat=,args="], capture_output=True, text=True,
                         check=True).stdout
    me = str(os.getpid())
    return [line for line in out.splitlines()
            if marker in line and line.split()[0] != me and not line.split()[1].startswith("Z")
            and "ps -ww" not in line]


def rank_pid_in(run_id: str, workdir: Path, timeout: float = 60) -> int:
    """The interpreter of run ``run_id``'s rank running in ``workdir`` (its shell's child)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in processes_with(run_id):
            pid, args = int(line.split()[0]), line.split()[2:]
            if args[:3] != [PYTHON, "-m", "meshtrain"]:
                continue
            try:
                if os.readlink(f"/proc/{pid}/cwd") == str(workdir):
                    return pid
            except OSError:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no rank of {run_id} in {workdir}")


def rank_processes(marker: str, script: str) -> list[str]:
    """The ranks' own interpreters running ``script`` (not their shells, not the launcher)."""
    return [line for line in processes_with(marker)
            if line.split()[2] == PYTHON and line.split()[3] == script]


def wait_until_gone(marker: str, timeout: float) -> list[str]:
    """Wait for every process with ``marker`` to end; returns those still alive after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = processes_with(marker)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def meshtrain(world: SshWorld, *args: str, cwd: Path,
              timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the ``meshtrain`` command where the launcher belongs (the client namespace, if any);
    output captured (piped).

    It runs in this process (``in_process.meshtrain_here``, switched into the client
    namespace as ``ip netns exec`` would switch a new process): a new interpreter would spend
    ~3.5 s of CPU on this machine importing torch and the CLI first, and the suite is
    CPU-bound. A command the test signals or reads while it runs is a real process
    (:func:`start_meshtrain`)."""
    return meshtrain_here(*args, cwd=cwd, timeout=timeout, netns=world.client_netns)


def start_meshtrain(world: SshWorld, *args: str, cwd: Path) -> subprocess.Popen[str]:
    """Start the ``meshtrain`` command in the background, stdout and stderr merged."""
    return subprocess.Popen(world.command(PYTHON, "-m", "meshtrain", *args), cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def read_until(proc: subprocess.Popen[str], needles: list[str], timeout: float) -> str:
    """Read ``proc``'s output until every needle appeared, each with the rest of its line;
    fails the test on timeout. Returns everything read (a caller that reads on gets the
    output from there: ``seen + rest``).

    It reads the pipe's descriptor itself, whatever has arrived, never through
    ``proc.stdout``'s buffer: a buffered ``readline`` after ``select`` may pull two lines out
    of the pipe and return one, and ``select`` then never reports the other (it sits in the
    buffer, not in the pipe), so a test waiting for it timed out although it was printed."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    seen, deadline = "", time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while not all(n in seen and "\n" in seen[seen.index(n):] for n in needles):
            chunk = os.read(fd, 65536) if sel.select(0.2) else None
            # b"": the process closed its output, so nothing more will come
            if time.monotonic() > deadline or chunk == b"":
                raise AssertionError(f"did not see {needles} in output:\n{seen}")
            seen += decoder.decode(chunk or b"")
    return seen + decoder.decode(b"", final=True)
