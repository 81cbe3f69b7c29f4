"""Read and extend an OpenSSH known_hosts file the way OpenSSH does.

paramiko's own loader raises on the first line it cannot decode (a key glued to the
previous line, an ``@revoked`` or ``@cert-authority`` marker line), which makes every
host fail. Here, as in OpenSSH, a line that cannot be read is skipped, marker lines are
understood (``@revoked`` keys are refused for the hosts they match; ``@cert-authority``
lines are skipped, host certificates are not supported), and new keys are appended
safely: a newline first if the file lacks a final one, the whole file replaced at once.
"""

from __future__ import annotations

import binascii
import os
import re
import tempfile
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

    The file is rewritten to a temporary file beside it and renamed over it, so a crash
    never leaves half a line, and a missing final newline is added first so the new key
    never ends up glued to the last line.
    """
    file = Path(os.path.realpath(path))  # a symlinked file stays a symlink
    line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
    with _append_lock:
        file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        old = file.read_text() if file.exists() else ""
        if line in old.splitlines(True) or line.rstrip("\n") in old.splitlines():
            return
        text = old + ("\n" if old and not old.endswith("\n") else "") + line
        mode = file.stat().st_mode & 0o777 if file.exists() else 0o644
        fd, temp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(temp, mode)
            os.replace(temp, file)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
