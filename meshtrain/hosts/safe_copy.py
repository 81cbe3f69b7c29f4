"""Unpack a run directory that a host sends back, treating every byte as hostile.

A compromised rank 0 host controls the tar stream (or the SFTP listing) the launcher
reads at the end of a launch. tarfile's own extraction follows symlinks it created a
moment earlier (the ``filter="data"`` bypasses of unpatched Pythons), and an SFTP name
can be absolute or hold ``..``. So nothing here calls tarfile's extract, and nothing
joins a host's name onto a local path:

- only regular files and directories are created; a symlink, hardlink, device, fifo or
  any other kind of entry stops the copy;
- every name is relative, without ``..``, NUL or control characters, and bounded in
  length and depth;
- the number of entries and the total bytes are capped (:class:`CopyLimits`; the user
  raises them with ``--copy-back-limit`` / ``--copy-back-files``);
- everything is created below a fresh directory made here, through directory file
  descriptors: directories opened with ``O_DIRECTORY|O_NOFOLLOW``, files created with
  ``O_CREAT|O_EXCL|O_NOFOLLOW``. That directory is renamed into place only when the copy
  is complete, and removed on any failure, so nothing half-written remains.

A violation raises :class:`UnsafeRunDirectory`, whose message names the entry
(``link 'a' -> '/etc'``); the launcher prefixes the host.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import tarfile
import unicodedata
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from meshtrain.config.launching import DEFAULT_MAX_FILES
from meshtrain.errors import RunFailure

CHUNK = 1 << 16
MAX_NAME_BYTES = 255  # one path component (NAME_MAX on Linux and macOS)
MAX_PATH_BYTES = 1024  # a whole relative path (macOS's PATH_MAX is 1024)
MAX_DEPTH = 64  # directory levels
MAX_HEADER_BYTES = 1 << 20  # a pax or GNU long-name header: names are short, this is generous
DEFAULT_MAX_BYTES = 64 << 30  # 64 GiB: a run directory with a few large models
SFTP_WINDOW = 16 << 20  # bytes asked for at once over SFTP: as fast as one request for a whole file


@dataclass(frozen=True)
class CopyLimits:
    """How much a host may send back."""

    max_bytes: int = DEFAULT_MAX_BYTES  # file contents in total
    max_files: int = DEFAULT_MAX_FILES  # entries (files and directories)


class UnsafeRunDirectory(RunFailure):  # noqa: N818 - a refusal, named for what was refused
    """A host sent something the launcher will not create; the message names the entry."""


def shown(name: str) -> str:
    """``name`` quoted for a message, without the ``./`` that ``tar -cf - .`` puts first,
    control characters made visible (``\\x1b``)."""
    while name.startswith("./") and len(name) > 2:
        name = name[2:]
    return "'" + "".join(f"\\x{ord(c):02x}" if unicodedata.category(c) == "Cc" else c
                         for c in name) + "'"


def checked_parts(name: str) -> list[str]:
    """The components of a host-supplied relative path; raises :class:`UnsafeRunDirectory`.

    A leading ``./`` (what ``tar -cf - .`` writes) and ``.`` components are dropped; an
    empty result is the directory itself.
    """
    if "\x00" in name:
        raise UnsafeRunDirectory(f"name {shown(name)} holds a NUL byte")
    if name.startswith("/"):
        raise UnsafeRunDirectory(f"absolute name {shown(name)}")
    if len(name.encode(errors="surrogateescape")) > MAX_PATH_BYTES:
        raise UnsafeRunDirectory(f"name {shown(name[:80])}... is longer than {MAX_PATH_BYTES} bytes")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    for part in parts:
        check_component(part, name)
    if len(parts) > MAX_DEPTH:
        raise UnsafeRunDirectory(f"name {shown(name[:80])}... is deeper than {MAX_DEPTH} levels")
    return parts


def check_component(part: str, name: str) -> None:
    """One path component: not ``..``, no separator, no control character, bounded."""
    if part == "..":
        raise UnsafeRunDirectory(f"name {shown(name)} goes up a directory ('..')")
    if part in ("", ".") or "/" in part or "\x00" in part:
        raise UnsafeRunDirectory(f"name {shown(name)} is not a plain file name")
    if any(unicodedata.category(c) == "Cc" for c in part):
        raise UnsafeRunDirectory(f"name {shown(name)} holds a control character")
    if len(part.encode(errors="surrogateescape")) > MAX_NAME_BYTES:
        raise UnsafeRunDirectory(f"name {shown(name[:80])}... has a part longer than {MAX_NAME_BYTES} bytes")


class _Budget:
    """Counts entries and bytes against the limits."""

    def __init__(self, limits: CopyLimits) -> None:
        self.limits, self.files, self.bytes = limits, 0, 0

    def entry(self, name: str) -> None:
        self.files += 1
        if self.files > self.limits.max_files:
            raise UnsafeRunDirectory(f"more than {self.limits.max_files} entries (at {shown(name)}); "
                                     "raise the cap with --copy-back-files")

    def take(self, size: int, name: str) -> None:
        if self.bytes + size > self.limits.max_bytes:
            raise UnsafeRunDirectory(f"more than {self.limits.max_bytes} bytes in total (at {shown(name)}); "
                                     "raise the cap with --copy-back-limit")
        self.bytes += size


# --------------------------------------------------------------------------- the new directory
@contextmanager
def fresh_directory(final: Path) -> Iterator[int]:
    """A new directory beside ``final`` (which must not exist), as an open descriptor;
    renamed to ``final`` when the block completes, removed (with all in it) otherwise."""
    temporary = final.parent / f".{final.name}.copying-{secrets.token_hex(4)}"
    os.mkdir(temporary, 0o777)  # fails if the name exists: it is ours alone; mode per umask
    fd = os.open(temporary, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        yield fd
        os.close(fd)
        fd = -1
        os.rename(temporary, final)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        shutil.rmtree(temporary, ignore_errors=True)  # rmtree never follows a link out of it
        raise


def _open_dir(parent: int, part: str, *, create: bool) -> int:
    """The subdirectory ``part`` of ``parent`` (made if ``create`` and absent), never a link."""
    if create:
        try:
            os.mkdir(part, 0o777, dir_fd=parent)
        except FileExistsError:
            pass  # listed twice, or made for an earlier file: O_NOFOLLOW below checks what it is
    try:
        return os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    except (NotADirectoryError, FileNotFoundError):
        raise UnsafeRunDirectory(f"{shown(part)} is used both as a file and a directory") from None


def _walk(root: int, parts: list[str]) -> int:
    """A new descriptor for the directory ``parts`` below ``root``, made as needed."""
    fd = os.dup(root)
    for part in parts:
        try:
            child = _open_dir(fd, part, create=True)
        finally:
            os.close(fd)
        fd = child
    return fd


def _write_file(parent: int, part: str, name: str, mode: int, read: Callable[[int], bytes],
                size: int | None, budget: _Budget) -> None:
    """Create ``part`` in ``parent`` (it must not exist) with what ``read`` gives."""
    if size is not None:
        budget.take(size, name)  # the header's size, checked before reading a byte
    executable = 0o777 if mode & 0o111 else 0o666  # umask applies, like any new file
    try:
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, executable, dir_fd=parent)
    except FileExistsError:
        raise UnsafeRunDirectory(f"{shown(name)} is sent twice") from None
    with os.fdopen(fd, "wb") as out:
        while block := read(CHUNK):
            if size is None:
                budget.take(len(block), name)
            out.write(block)


# --------------------------------------------------------------------------- tar
class _BoundedTarInfo(tarfile.TarInfo):
    """Refuses, before tarfile reads it into memory, an extended header larger than
    :data:`MAX_HEADER_BYTES`, and sparse files (their maps are read unbounded)."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> Any:  # tarfile's hook, one per header
        if self.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE,
                         tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK) \
                and self.size > MAX_HEADER_BYTES:
            raise UnsafeRunDirectory(f"an extended tar header of {self.size} bytes")
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise UnsafeRunDirectory(f"sparse file {shown(self.name)}")
        return super()._proc_member(tarfile_)  # type: ignore[misc]


def _describe(member: tarfile.TarInfo) -> str:
    name = shown(member.name)
    if member.issym():
        return f"link {name} -> {shown(member.linkname)}"
    if member.islnk():
        return f"hardlink {name} -> {shown(member.linkname)}"
    if member.ischr() or member.isblk():
        return f"device {name}"
    if member.isfifo():
        return f"fifo {name}"
    return f"entry {name} of tar type {member.type!r}"


def unpack_tar(stream: IO[bytes], final: Path, limits: CopyLimits = CopyLimits()) -> None:
    """Create ``final`` (which must not exist) from the uncompressed tar ``stream``.

    Raises :class:`UnsafeRunDirectory` (and leaves nothing) on a forbidden entry,
    ``tarfile.TarError`` on a broken stream.
    """
    budget = _Budget(limits)
    with fresh_directory(final) as root, \
            tarfile.open(fileobj=stream, mode="r|", tarinfo=_BoundedTarInfo) as archive:
        for member in archive:
            budget.entry(member.name)
            if not (member.isreg() or member.isdir()):
                raise UnsafeRunDirectory(_describe(member))
            parts = checked_parts(member.name)
            if member.isdir():
                os.close(_walk(root, parts))
                continue
            if not parts:
                raise UnsafeRunDirectory(f"file {shown(member.name)} has no name")
            source = archive.extractfile(member)
            assert source is not None  # a regular file always has contents
            parent = _walk(root, parts[:-1])
            try:
                _write_file(parent, parts[-1], member.name, member.mode, source.read, member.size, budget)
            finally:
                os.close(parent)


# --------------------------------------------------------------------------- sftp
def unpack_sftp(sftp: Any, remote: str, final: Path, limits: CopyLimits = CopyLimits(),
                before_read: Callable[[], None] = lambda: None) -> None:
    """Create ``final`` (which must not exist) from the folder ``remote`` over SFTP
    (a paramiko ``SFTPClient``), under the same rules as :func:`unpack_tar`.
    ``before_read`` is called before each listing and each window of
    :data:`SFTP_WINDOW` bytes; what it raises stops the copy, leaving nothing."""
    budget = _Budget(limits)
    with fresh_directory(final) as root:
        _sftp_folder(sftp, remote, "", root, budget, before_read)


def _sftp_folder(sftp: Any, remote: str, relative: str, fd: int, budget: _Budget,
                 before_read: Callable[[], None]) -> None:
    if relative.count("/") >= MAX_DEPTH:
        raise UnsafeRunDirectory(f"{shown(relative)} is deeper than {MAX_DEPTH} levels")
    before_read()
    for entry in sftp.listdir_attr(remote):
        name = f"{relative}{entry.filename}"
        check_component(entry.filename, name)
        budget.entry(name)
        mode = entry.st_mode
        if mode is None:
            raise UnsafeRunDirectory(f"entry {shown(name)} has no type")
        source = f"{remote}/{entry.filename}"
        if stat.S_ISDIR(mode):
            child = _open_dir(fd, entry.filename, create=True)
            try:
                _sftp_folder(sftp, source, name + "/", child, budget, before_read)
            finally:
                os.close(child)
        elif stat.S_ISREG(mode):
            announced = entry.st_size or 0
            if budget.bytes + announced > budget.limits.max_bytes:
                budget.take(announced, name)  # refuses, naming the cap
            with sftp.open(source, "rb") as remote_file:
                read = _windowed_reads(remote_file, announced, before_read)
                _write_file(fd, entry.filename, name, mode, read, None, budget)
        elif stat.S_ISLNK(mode):
            raise UnsafeRunDirectory(f"link {shown(name)} -> {shown(_link_target(sftp, source))}")
        elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            raise UnsafeRunDirectory(f"device {shown(name)}")
        elif stat.S_ISFIFO(mode):
            raise UnsafeRunDirectory(f"fifo {shown(name)}")
        else:
            raise UnsafeRunDirectory(f"entry {shown(name)} of mode {mode:o}")


def _windowed_reads(remote_file: Any, announced: int,
                    before_read: Callable[[], None]) -> Callable[[int], bytes]:
    """Reads of an SFTP file for :func:`_write_file`: the announced size in windows of
    :data:`SFTP_WINDOW`, each fetched with pipelined requests (paramiko's ``readv``) and read
    to its end before the next, so no paramiko prefetch thread is still sending requests when
    a copy stops (one would die on the closed channel, printing a traceback). Past the
    announced size (a file that grew), plain reads to the real end."""
    window: Iterator[bytes] = iter(())
    offset = 0

    def read(size: int) -> bytes:
        nonlocal window, offset
        block = next(window, None)
        if block is not None:
            return bytes(block)
        if offset >= announced:
            return bytes(remote_file.read(size))
        before_read()
        end = min(offset + SFTP_WINDOW, announced)
        window = remote_file.readv([(at, min(CHUNK, end - at)) for at in range(offset, end, CHUNK)])
        offset = end
        return bytes(next(window, b""))

    return read


def _link_target(sftp: Any, path: str) -> str:
    try:
        return str(sftp.readlink(path))[:MAX_PATH_BYTES]
    except Exception:  # noqa: BLE001 - only for the message
        return "?"
