"""An authenticated rendezvous: only ranks that know this launch's secret reach the store.

torch's TCPStore has no authentication: anyone who can reach its port can read and write
keys, join the group as a missing rank, or grow rank 0's memory. So under ``meshtrain
launch`` the store never faces the network. Rank 0 runs it on 127.0.0.1, and a small gate
listens on the rendezvous address and port instead. Every connection must pass a mutual
HMAC-SHA256 challenge with the launch's secret before a single byte reaches the store:

    gate -> rank : nonce_g (32 random bytes)
    rank -> gate : nonce_r, HMAC(secret, "rank" | nonce_g | nonce_r)
    gate -> rank : HMAC(secret, "gate" | nonce_r | nonce_g)

A connection that fails is closed and reported on rank 0's output, naming the peer. The
other ranks reach the gate through a local tunnel (127.0.0.1 -> gate) that runs the
rank's side of the handshake, so torch's store client is unchanged. The gate admits
world_size - 1 connections and then stops listening; gate and tunnel both close their
listening sockets once the group has formed (the admitted connections live on), and at
most a few handshakes run at once, so a flood of connections costs no more than that. The secret is made
by the launcher for each launch and delivered over SSH (the trust root) in a 0600 file
the rank reads and deletes at start, never on a command line.

Not protected: the training traffic itself (gloo's connections between ranks) is neither
authenticated nor encrypted; run launches on a network you trust.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import sys
import threading
from pathlib import Path

SECRET_FILE_ENV = "MESHTRAIN_SECRET_FILE"
HANDSHAKE_TIMEOUT_S = 10.0
#: Handshakes the gate runs at once; further connections are closed unanswered.
MAX_PENDING_HANDSHAKES = 16


def new_secret() -> str:
    """A fresh launch secret (64 hex characters)."""
    return secrets.token_hex(32)


def take_secret() -> bytes | None:
    """This rank's launch secret from the file the launcher wrote (the file is removed)."""
    name = os.environ.get(SECRET_FILE_ENV)
    if not name:
        return None
    path = Path(name)
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise RuntimeError(f"cannot read the launch secret {path}: {exc.strerror}") from None
    path.unlink(missing_ok=True)
    if len(text) < 32:
        raise RuntimeError(f"the launch secret in {path} is too short")
    return text.encode()


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
            threading.Thread(target=self.serve, args=(conn, peer), daemon=True).start()

    def serve(self, conn: socket.socket, peer: tuple) -> None:  # pragma: no cover - abstract
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
    store on 127.0.0.1:``store_port``, at most ``admissions`` of them (the other ranks)."""

    def __init__(self, address: str, port: int, store_port: int, secret: bytes,
                 admissions: int | None = None) -> None:
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
        self._pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        super().__init__(sock)

    def serve(self, conn: socket.socket, peer: tuple) -> None:
        if not self._pending.acquire(blocking=False):
            conn.close()  # a flood: the real ranks connect once each and retry
            return
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            gate_handshake(conn, self.secret)
        except (OSError, ConnectionError, PermissionError) as exc:
            print(f"meshtrain: refused a rendezvous connection from {peer[0]}:{peer[1]}: {exc}",
                  file=sys.stderr, flush=True)
            conn.close()
            return
        finally:
            self._pending.release()
        with self._lock:
            if self.admissions_left is not None:
                if self.admissions_left <= 0:
                    conn.close()
                    return
                self.admissions_left -= 1
                if self.admissions_left == 0:
                    self.close()  # every rank is in: nobody else may come
        conn.settimeout(None)
        store = socket.create_connection(("127.0.0.1", self.store_port))
        _pipe(conn, store)


class Tunnel(_Listener):
    """Ranks other than 0: a local port whose connections reach the gate, authenticated."""

    def __init__(self, address: str, port: int, secret: bytes) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.target = (address, port)
        self.secret = secret
        super().__init__(sock)

    def serve(self, conn: socket.socket, peer: tuple) -> None:
        try:
            remote = socket.create_connection(self.target, timeout=HANDSHAKE_TIMEOUT_S)
            rank_handshake(remote, self.secret)
            remote.settimeout(None)
        except (OSError, ConnectionError, PermissionError) as exc:
            print(f"meshtrain: rendezvous at {self.target[0]}:{self.target[1]}: {exc}",
                  file=sys.stderr, flush=True)
            conn.close()
            return
        _pipe(conn, remote)
