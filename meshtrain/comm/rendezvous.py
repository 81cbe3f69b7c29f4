"""An authenticated rendezvous: only ranks that know this launch's secret reach the store.

torch's TCPStore has no authentication: anyone who can reach its port can read and write
keys, join the group as a missing rank, or grow rank 0's memory. So under ``meshtrain
launch`` the store never faces the network. Rank 0 runs it on 127.0.0.1, and a small gate
listens on the rendezvous address and port instead. Every connection must pass a mutual
HMAC-SHA256 challenge with the launch's secret before a single byte reaches the store:

    gate -> rank : nonce_g (32 random bytes)
    rank -> gate : nonce_r, HMAC(secret, "rank" | nonce_g | nonce_r)
    gate -> rank : HMAC(secret, "gate" | nonce_r | nonce_g)

A connection that fails is closed and reported on rank 0's output, naming the peer.

The gate knows the inventory (``MESHTRAIN_PEERS``: the other hosts' names and addresses,
which rank 0 resolves): a connection from any other address is closed as soon as it is
accepted, before any handshake, so machines outside the run cannot hold the gate's
slots. Each address may run only as many handshakes at once as ranks come from it (plus
one, for a retry), and each handshake has a short deadline, so every expected rank keeps
a slot even while an inventory host misbehaves. In a ``launch --elastic`` run the list
also holds the launcher's own address, and grows only when the launcher, having passed
the gate with the secret, asks rank 0 to add a host (:meth:`Gate.allow`,
:mod:`meshtrain.comm.membership`).

The other ranks reach the gate through a local tunnel (127.0.0.1 -> gate) that runs the
rank's side of the handshake, so torch's store client is unchanged. The tunnel accepts
exactly one connection, the rank's own store client (on Linux a connection from another
process is refused), and then stops listening. The gate
admits world_size - 1 connections and then stops listening; both close their listening
sockets once the group has formed (the admitted connections live on). The secret is made
by the launcher for each launch and delivered over SSH (the trust root) in a private
directory the rank reads, checks and deletes at start, never on a command line.

Not protected: after the handshake the store's traffic is neither encrypted nor
authenticated (a passive observer on the LAN can read it), and the training traffic
itself (gloo's connections between ranks) is neither authenticated nor encrypted.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import stat
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SECRET_FILE_ENV = "MESHTRAIN_SECRET_FILE"
#: The launcher's private folder for one rank's secret starts with this (removed once read).
SECRET_FOLDER_PREFIX = ".meshtrain-secret-"
#: The other ranks' hosts, comma-separated, each as its names and addresses separated by
#: spaces ("10.0.0.2 box2.lan,10.0.0.3"): the gate admits connections from these only.
PEERS_ENV = "MESHTRAIN_PEERS"
#: A tunnel's connection to the gate, and its handshake (a real rank answers at once).
HANDSHAKE_TIMEOUT_S = 10.0
#: The gate's deadline for a peer's answer: short, so a silent peer frees its slot soon.
GATE_HANDSHAKE_TIMEOUT_S = 5.0
#: Handshakes the gate runs at once when it has no list of peers (outside ``meshtrain launch``).
MAX_PENDING_HANDSHAKES = 16


def new_secret() -> str:
    """A fresh launch secret (64 hex characters)."""
    return secrets.token_hex(32)


def take_secret() -> bytes | None:
    """This rank's launch secret from the file the launcher wrote; the file and its
    private directory are removed. The file is opened without following a symlink and
    must be this user's, in a directory of this user's that nobody else can enter."""
    name = os.environ.get(SECRET_FILE_ENV)
    if not name:
        return None
    path = Path(name)
    try:
        folder = os.lstat(path.parent)
        if (not stat.S_ISDIR(folder.st_mode) or folder.st_uid != os.geteuid()
                or folder.st_mode & 0o077):
            raise RuntimeError(f"the launch secret's folder {path.parent} is not a private folder of "
                               "this user's (another user may have planted it)")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
                raise RuntimeError(f"the launch secret {path} is not a private file of this user's")
            text = os.read(fd, 4096).decode(errors="replace").strip()
        finally:
            os.close(fd)
    except OSError as exc:
        raise RuntimeError(f"cannot read the launch secret {path}: {exc.strerror}") from None
    path.unlink(missing_ok=True)
    if path.parent.name.startswith(SECRET_FOLDER_PREFIX):
        try:
            path.parent.rmdir()
        except OSError:
            pass  # not empty (something else was put there): left for the launcher's clean-up
    if len(text) < 32:
        raise RuntimeError(f"the launch secret in {path} is too short")
    return text.encode()


def peer_addresses(hosts: Iterable[Iterable[str]]) -> Counter[str]:
    """The addresses the gate admits: every address each host's names resolve to, counted
    once per host (a machine that runs several ranks may run that many handshakes at once)."""
    found: Counter[str] = Counter()
    for names in hosts:
        addresses: set[str] = set()
        for name in names:
            try:
                infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
            except OSError:
                print(f"meshtrain: cannot resolve inventory host {name!r}; a rank connecting from "
                      "its address will be refused", file=sys.stderr, flush=True)
                continue
            addresses |= {_canonical(str(info[4][0])) for info in infos}
        found.update(addresses)
    return found


def peers_from_env() -> Counter[str] | None:
    """The gate's allowed addresses from ``MESHTRAIN_PEERS`` (unset: no list, admit anyone;
    empty: a world of one, admit nobody)."""
    raw = os.environ.get(PEERS_ENV)
    if raw is None:
        return None
    return peer_addresses(entry.split() for entry in raw.split(",") if entry.strip())


def _canonical(address: str) -> str:
    """One spelling per address: no zone index, IPv4-mapped IPv6 as IPv4."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def _mac(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        data += chunk
    return data


def gate_handshake(sock: socket.socket, secret: bytes) -> None:
    """The gate's side: raise ``PermissionError`` unless the peer proves the secret."""
    nonce_g = secrets.token_bytes(32)
    sock.sendall(nonce_g)
    answer = _read_exactly(sock, 64)
    nonce_r, proof = answer[:32], answer[32:]
    if not hmac.compare_digest(proof, _mac(secret, b"rank", nonce_g, nonce_r)):
        raise PermissionError("it does not know this launch's secret")
    sock.sendall(_mac(secret, b"gate", nonce_r, nonce_g))


def rank_handshake(sock: socket.socket, secret: bytes) -> None:
    """A rank's side: prove the secret, and check the gate knows it too."""
    nonce_g = _read_exactly(sock, 32)
    nonce_r = secrets.token_bytes(32)
    sock.sendall(nonce_r + _mac(secret, b"rank", nonce_g, nonce_r))
    if not hmac.compare_digest(_read_exactly(sock, 32), _mac(secret, b"gate", nonce_r, nonce_g)):
        raise PermissionError("the rendezvous answered without this launch's secret (another launch?)")


def _pipe(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until either side closes."""

    def one_way(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    threading.Thread(target=one_way, args=(a, b), daemon=True).start()
    threading.Thread(target=one_way, args=(b, a), daemon=True).start()


class _Listener:
    """Accepts connections on a bound socket and hands each to ``serve`` in a thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.port = sock.getsockname()[1]
        sock.listen(128)
        threading.Thread(target=self._accept, daemon=True, name=type(self).__name__).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return  # closed
            if not self.welcome(conn, peer):
                conn.close()
                continue
            threading.Thread(target=self.serve, args=(conn, peer), daemon=True).start()

    def welcome(self, conn: socket.socket, peer: tuple[Any, ...]) -> bool:
        """Whether to serve a connection just accepted (False: it is closed at once)."""
        return True

    def serve(self, conn: socket.socket, peer: tuple[Any, ...]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        """Stop listening now. shutdown() first: a bare close() neither wakes the thread
        blocked in accept() nor, while that call holds the socket, stops the listening."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # macOS: a listening socket is "not connected"; close() suffices there
        self.sock.close()


class Gate(_Listener):
    """Rank 0: listens on the rendezvous ``address:port``; admits only proven ranks to the
    store on 127.0.0.1:``store_port``, at most ``admissions`` of them (the other ranks).

    With ``peers`` (address -> ranks expected from it) a connection from any other address
    is closed unanswered, and each address runs at most its ranks + 1 handshakes at once.
    """

    def __init__(self, address: str, port: int, store_port: int, secret: bytes,
                 admissions: int | None = None, peers: Counter[str] | None = None) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        # The gate closes refused connections itself, which leaves them in TIME_WAIT on this
        # port for a minute; without SO_REUSEADDR the next launch would find it "in use".
        # (A port another program listens on is still refused, on Linux and macOS alike.)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError as exc:
            sock.close()
            if exc.errno in (98, 48):  # EADDRINUSE on Linux, macOS
                raise RuntimeError(f"rendezvous port {port} on {address} is in use (another launch "
                                   "still running?): pick another rendezvous.port") from None
            raise RuntimeError(f"cannot listen on {address}:{port}: {exc.strerror}") from None
        self.store_port = store_port
        self.secret = secret
        self.admissions_left = admissions
        self._lock = threading.Lock()
        self.peers = peers
        self._pending: Counter[str] = Counter()  # handshakes running, per address
        self._strangers: set[str] = set()  # addresses already reported as not in the inventory
        super().__init__(sock)

    def welcome(self, conn: socket.socket, peer: tuple[Any, ...]) -> bool:
        address = _canonical(peer[0])
        with self._lock:
            if self.peers is not None and address not in self.peers:
                if address not in self._strangers:  # once per address: a flood is one line
                    self._strangers.add(address)
                    print(f"meshtrain: refused a rendezvous connection from {address}:{peer[1]}: not "
                          "an inventory host's address (further ones from it are closed silently)",
                          file=sys.stderr, flush=True)
                return False
            limit = self.peers[address] + 1 if self.peers is not None else MAX_PENDING_HANDSHAKES
            used = self._pending[address] if self.peers is not None else sum(self._pending.values())
            if used >= limit:
                return False  # a real rank connects once and retries if refused
            self._pending[address] += 1
            return True

    def allow(self, names: Iterable[str]) -> None:
        """Admit connections from one more host (a host added to a running elastic run):
        ``names`` are its inventory names and addresses, resolved here as the inventory's are."""
        found = peer_addresses([list(names)])
        with self._lock:
            if self.peers is not None:
                self.peers.update(found)
            self._strangers -= set(found)

    def serve(self, conn: socket.socket, peer: tuple[Any, ...]) -> None:
        address = _canonical(peer[0])
        try:
            conn.settimeout(GATE_HANDSHAKE_TIMEOUT_S)
            gate_handshake(conn, self.secret)
        except (OSError, ConnectionError, PermissionError) as exc:
            print(f"meshtrain: refused a rendezvous connection from {peer[0]}:{peer[1]}: {exc}",
                  file=sys.stderr, flush=True)
            conn.close()
            return
        finally:
            with self._lock:
                self._pending[address] -= 1
        with self._lock:
            if self.admissions_left is not None:
                if self.admissions_left <= 0:
                    conn.close()
                    return
                self.admissions_left -= 1
                if self.admissions_left == 0:
                    self.close()  # every rank is in: nobody else may come
        conn.settimeout(None)
        try:
            store = socket.create_connection(("127.0.0.1", self.store_port))
        except OSError as exc:  # rank 0 has stopped (its store with it): the rank finds out itself
            print(f"meshtrain: could not admit the rank from {peer[0]}:{peer[1]}: the rendezvous "
                  f"store is gone ({exc.strerror or exc})", file=sys.stderr, flush=True)
            conn.close()
            return
        _pipe(conn, store)


def _from_this_process(peer_port: int, local_port: int) -> bool:
    """Whether the loopback connection from ``peer_port`` to ``local_port`` was opened by
    this process (Linux: its socket's inode is one of our descriptors). Elsewhere there
    is no cheap way to tell: True."""
    if not sys.platform.startswith("linux"):
        return True
    wanted = f":{peer_port:04X}", f":{local_port:04X}"
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            return True  # no /proc: cannot tell
        for line in lines:
            fields = line.split()
            if fields[1].endswith(wanted[0]) and fields[2].endswith(wanted[1]):
                inodes.add(f"socket:[{fields[9]}]")
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") in inodes:
                return True
        except OSError:
            continue
    return False


class Tunnel(_Listener):
    """Ranks other than 0: a local port whose one connection (the rank's store client)
    reaches the gate, authenticated. After that connection the tunnel stops listening:
    no other local process can borrow the rank's admission."""

    def welcome(self, conn: socket.socket, peer: tuple[Any, ...]) -> bool:
        if not _from_this_process(peer[1], self.port):
            print(f"meshtrain: refused a local connection to the rendezvous tunnel from port {peer[1]}: "
                  "another process on this machine (not this rank)", file=sys.stderr, flush=True)
            return False
        self.close()  # exactly one connection: the rank's own store client
        return True

    def __init__(self, address: str, port: int, secret: bytes, timeout_s: float = 60.0) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.target = (address, port)
        self.secret = secret
        self.timeout_s = timeout_s
        super().__init__(sock)

    def serve(self, conn: socket.socket, peer: tuple[Any, ...]) -> None:
        # The listener is closed now, so the store client cannot retry through it: the
        # tunnel waits for the gate itself (rank 0 may still be starting).
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                remote = socket.create_connection(self.target, timeout=HANDSHAKE_TIMEOUT_S)
            except OSError as exc:
                if time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                problem: BaseException = exc
                break
            try:
                rank_handshake(remote, self.secret)
                remote.settimeout(None)
                _pipe(conn, remote)
                return
            except ConnectionError as exc:  # the gate was busy: a fresh connection may pass
                remote.close()
                if time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                problem = exc
                break
            except (OSError, PermissionError) as exc:
                remote.close()
                problem = exc
                break
        print(f"meshtrain: rendezvous at {self.target[0]}:{self.target[1]}: {problem}",
              file=sys.stderr, flush=True)
        conn.close()
