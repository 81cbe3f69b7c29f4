"""Read and extend an OpenSSH known_hosts file the way OpenSSH does.

paramiko's own loader raises on the first line it cannot decode (a key glued to the
previous line, an ``@revoked`` or ``@cert-authority`` marker line), which makes every
host fail. Here, as in OpenSSH, a line that cannot be read is skipped, marker lines are
understood (``@revoked`` keys are refused for the hosts they match; ``@cert-authority``
lines are skipped, host certificates are not supported), and new keys are appended
safely: a newline first if the file lacks a final one, one locked write.
"""

from __future__ import annotations

import binascii
import fcntl
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import paramiko
from paramiko.hostkeys import HostKeyEntry, InvalidHostKey

_append_lock = threading.Lock()  # ranks sharing a host connect at once: record its key once


@dataclass
class KnownHosts:
    """The usable keys of a known_hosts file and the revoked ones."""

    keys: paramiko.HostKeys = field(default_factory=paramiko.HostKeys)
    revoked: list[tuple[list[str], paramiko.PKey]] = field(default_factory=list)  # (patterns, key)
    skipped: list[int] = field(default_factory=list)  # line numbers that could not be read

    def is_revoked(self, hostname: str, key: paramiko.PKey) -> bool:
        """Whether ``key`` is marked ``@revoked`` for ``hostname`` (``[host]:port`` form off 22)."""
        return any(k.asbytes() == key.asbytes() and host_matches(hostname, patterns)
                   for patterns, k in self.revoked)


def load_known_hosts(path: str | os.PathLike[str]) -> KnownHosts:
    """Parse ``path`` (missing file: nothing known). Unreadable lines are skipped and listed."""
    known = KnownHosts()
    file = Path(path)
    if not file.is_file():
        return known
    entries: list[HostKeyEntry] = []
    for number, raw in enumerate(file.read_text(errors="replace").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("@"):
            marker, _, rest = line.partition(" ")
            if marker == "@revoked":
                entry = _entry(rest.strip(), number)
                if entry is None:
                    known.skipped.append(number)
                else:
                    known.revoked.append((entry.hostnames, entry.key))
            # @cert-authority (and markers we do not know) say nothing about plain keys.
            continue
        entry = _entry(line, number)
        if entry is None:
            known.skipped.append(number)
        else:
            entries.append(entry)
    for entry in entries:
        for name in entry.hostnames:
            known.keys.add(name, entry.key.get_name(), entry.key)
    return known


def _entry(line: str, number: int) -> HostKeyEntry | None:
    try:
        return HostKeyEntry.from_line(line, number)
    except (InvalidHostKey, paramiko.SSHException, binascii.Error, ValueError):
        return None


def host_matches(hostname: str, patterns: list[str]) -> bool:
    """OpenSSH host pattern matching: ``*`` and ``?`` wildcards, ``!`` negation, hashed names."""
    matched = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern[1:] if negated else pattern
        if pattern.startswith("|1|"):
            hit = paramiko.HostKeys.hash_host(hostname, pattern) == pattern
        else:  # only * and ? are special: "[127.0.0.1]:*" is brackets, not a character class
            regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
            hit = re.fullmatch(regex, hostname, re.IGNORECASE) is not None
        if hit and negated:
            return False
        matched = matched or hit
    return matched


def append_known_host(path: str | os.PathLike[str], hostname: str, key: paramiko.PKey) -> None:
    """Record ``hostname``'s ``key`` at the end of ``path`` unless that exact line is there.

    Like OpenSSH, an append to the file itself (its permissions, owner and any symlink
    stay as they are), under an exclusive lock so that two launchers recording at once
    neither interleave nor record a key twice. A missing final newline is added first,
    so the new key never ends up glued to the last line; the line goes out in one write.
    """
    line = f"{hostname} {key.get_name()} {key.get_base64()}\n".encode()
    file = Path(path)
    with _append_lock:
        file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(file, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            size = os.fstat(fd).st_size
            old = os.pread(fd, size, 0) if size else b""
            if line in old.splitlines(True) or line.rstrip(b"\n") in old.splitlines():
                return
            os.write(fd, (b"\n" if old and not old.endswith(b"\n") else b"") + line)
            os.fsync(fd)
        finally:
            os.close(fd)  # also releases the lock
