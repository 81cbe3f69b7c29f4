"""Files to and from a host without assuming SFTP.

Some sshd configurations (and hardened Macs) drop the ``Subsystem sftp`` line, and
paramiko then fails with a bare "Channel closed". Uploads use SFTP where the host
offers it (:func:`has_sftp`, also shown by ``hosts check``) and otherwise pipe the
file's bytes into ``cat``. A run directory comes back as one tar stream over an
ordinary command (``tar -cf - .`` exists on Linux and macOS alike): no SFTP needed, no
round trip per file. SFTP is the fallback for a host without tar.

A copy can be stopped: :func:`fetch_tree` calls ``check_stop`` before every read (the
tar stream waits for bytes in slices of :data:`POLL_SECONDS`), and whatever that raises
ends the copy with nothing half-written. The launcher's Ctrl-C is such a check.
"""

from __future__ import annotations

import io
import secrets
import shutil
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paramiko

from meshtrain.errors import RunFailure
from meshtrain.hosts.safe_copy import CopyLimits, unpack_sftp, unpack_tar
from meshtrain.hosts.ssh import HostPath, Shell, run, sh, shell_line

CHUNK = 1 << 16
QUESTION_TIMEOUT = 10.0  # seconds for a yes/no question to a host (one that vanished never answers)
STALL_TIMEOUT = 60.0  # seconds a copy may go without receiving a byte
POLL_SECONDS = 0.2  # how often a wait for a host (a read, shipping's workers) calls check_stop


class TransferError(RunFailure):
    """A copy failed; the message says what and where."""


def has_sftp(client: paramiko.SSHClient) -> bool:
    """Whether the host's sshd serves the SFTP subsystem."""
    try:
        client.open_sftp().close()
        return True
    except (paramiko.SSHException, EOFError, OSError):
        return False


def sftp_path(path: str) -> str:
    """A host path as SFTP takes it: no ``~`` expansion, relative paths start at home."""
    if path == "~":
        return "."
    return path[2:] if path.startswith("~/") else path


def put_files(client: paramiko.SSHClient, folder: str, files: list[Path], *, use_sftp: bool,
              check_stop: Callable[[], None] = lambda: None) -> None:
    """Copy local ``files`` into the host's ``folder`` (which exists), keeping their modes.

    Each file is written to a hidden name beside its own and renamed only once all its
    bytes are there: an upload cut short (Ctrl-C, a dropped link) never leaves a partial
    file under the real name, and the hidden one is removed where the host can still do it.
    ``check_stop`` is called before every 32-64 KiB sent; what it raises stops the upload.
    """
    if not files:
        return
    if use_sftp:
        with client.open_sftp() as sftp:
            for f in files:
                target = f"{sftp_path(folder)}/{f.name}"
                partial = f"{sftp_path(folder)}/{_partial_name(f)}"
                try:
                    sftp.put(str(f), partial, callback=lambda sent, size: check_stop())  # checks the size
                    sftp.chmod(partial, f.stat().st_mode & 0o777)
                    sftp.posix_rename(partial, target)
                except BaseException:
                    _remove_quietly(sftp, partial)
                    raise
        return
    for f in files:
        target, partial = HostPath(f"{folder}/{f.name}"), HostPath(f"{folder}/{_partial_name(f)}")
        mode = f.stat().st_mode & 0o777
        # The host renames the file only if every byte came (a closed channel ends cat as
        # if the file were complete); $n unquoted drops the spaces macOS's wc puts first.
        command = shell_line(
            "cat", Shell(">"), partial, Shell("; n=$(wc -c <"), partial, Shell(");"),
            Shell("if [ $n -eq"), str(f.stat().st_size), Shell("]; then"),
            "chmod", f"{mode:o}", partial, Shell("&&"), "mv", "-f", partial, target,
            Shell("; else"), "rm", "-f", partial, Shell("; echo 'the upload was cut short' >&2; exit 1; fi"))
        channel = _exec(client, sh(command))
        try:
            with open(f, "rb") as source:
                while block := source.read(CHUNK):
                    check_stop()
                    channel.sendall(block)
            channel.shutdown_write()
            _check_status(channel, f"writing {folder}/{f.name}", check_stop)
        finally:
            channel.close()


def _partial_name(f: Path) -> str:
    return f".{f.name}.uploading-{secrets.token_hex(4)}"


def _remove_quietly(sftp: paramiko.SFTPClient, path: str) -> None:
    try:
        sftp.remove(path)
    except Exception:  # noqa: BLE001 - the host may be gone: nothing more can be done from here
        pass


def remote_dir_exists(client: paramiko.SSHClient, path: str) -> bool:
    """Whether ``path`` is a folder on the host."""
    return run(client, sh(shell_line("test", "-d", HostPath(path))), timeout=QUESTION_TIMEOUT).status == 0


def has_tar(client: paramiko.SSHClient) -> bool:
    """Whether ``tar`` can be run on the host."""
    command = shell_line("command", "-v", "tar", Shell(">/dev/null 2>&1"))
    return run(client, sh(command), timeout=QUESTION_TIMEOUT).status == 0


def fetch_tree(client: paramiko.SSHClient, remote: str, local: Path, *, use_sftp: bool,
               limits: CopyLimits = CopyLimits(), check_stop: Callable[[], None] = lambda: None) -> None:
    """Copy the host's folder ``remote`` to the new local folder ``local``: a tar stream,
    or SFTP if ``use_sftp`` (for a host without tar). Both are unpacked by
    :mod:`~meshtrain.hosts.safe_copy` (raises its UnsafeRunDirectory on a forbidden
    entry); on any failure ``local`` is not created.

    ``check_stop`` is called before every read, and at least every :data:`POLL_SECONDS`
    while the tar stream waits (over SFTP, before each window of ``SFTP_WINDOW`` bytes);
    what it raises stops the copy.
    """
    if use_sftp:
        with client.open_sftp() as sftp:
            sftp.get_channel().settimeout(STALL_TIMEOUT)
            unpack_sftp(sftp, sftp_path(remote), local, limits, before_read=check_stop)
        return
    channel = _exec(client, sh(shell_line("tar", "-C", HostPath(remote), "-cf", "-", ".")))
    try:
        with io.BufferedReader(_PolledChannel(channel, check_stop), CHUNK) as stream:
            unpack_tar(stream, local, limits)
        try:
            _check_status(channel, f"tar of {remote}", check_stop)
        except TransferError:
            shutil.rmtree(local)  # made just now by unpack_tar, links never followed
            raise
    except tarfile.TarError as exc:
        raise TransferError(f"tar stream of {remote} is broken: {exc}") from None
    finally:
        channel.close()


class _PolledChannel(io.RawIOBase):
    """A channel's stdout as a raw file whose reads call ``check`` every
    :data:`POLL_SECONDS` while they wait, and give up after :data:`STALL_TIMEOUT`."""

    def __init__(self, channel: paramiko.Channel, check: Callable[[], None]) -> None:
        super().__init__()
        self.channel = channel
        self.check = check
        channel.settimeout(POLL_SECONDS)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        """Wait for some bytes and put them in ``buffer``: how many (0 at the end)."""
        waiting_since = time.monotonic()
        while True:
            self.check()
            try:
                block = self.channel.recv(len(buffer))
            except TimeoutError:  # paramiko raises socket.timeout, the same class
                if time.monotonic() - waiting_since > STALL_TIMEOUT:
                    raise TransferError(f"the host sent nothing for {STALL_TIMEOUT:.0f} s") from None
                continue
            buffer[:len(block)] = block
            return len(block)


def _exec(client: paramiko.SSHClient, command: str) -> paramiko.Channel:
    transport = client.get_transport()
    if transport is None or not transport.is_active():
        raise TransferError("SSH connection is closed")
    channel = transport.open_session(timeout=QUESTION_TIMEOUT)
    channel.settimeout(STALL_TIMEOUT)  # a host that vanished mid-copy: an error, not a hang
    channel.exec_command(command)
    return channel


def _check_status(channel: paramiko.Channel, what: str, check_stop: Callable[[], None]) -> None:
    """Raise TransferError unless the command ended with status 0. A host that sent its
    bytes but never says how the command ended is an error after STALL_TIMEOUT, not a wait
    forever; ``check_stop`` is called while waiting."""
    waiting_since = time.monotonic()
    while not channel.status_event.wait(POLL_SECONDS):
        check_stop()
        if time.monotonic() - waiting_since > STALL_TIMEOUT:
            raise TransferError(f"{what}: the host did not say how it ended within {STALL_TIMEOUT:.0f} s")
    status = channel.recv_exit_status()
    if status != 0:
        error = b""
        while channel.recv_stderr_ready():
            error += channel.recv_stderr(CHUNK)
        detail = error.decode(errors="replace").strip().splitlines()
        raise TransferError(f"{what} failed on the host (status {status})"
                            + (f": {detail[-1]}" if detail else ""))
