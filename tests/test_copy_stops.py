"""How a copy stops: when the launcher asks (a signal), when the host goes silent, or
when an upload is cut short.

The launcher's signal handler once raised its exception wherever the main thread was. A
Ctrl-C that landed inside paramiko's wait for bytes (between a Condition's wait and its
lock's re-acquire) broke that lock, and the launch died with "release unlocked lock"
and exit 1 instead of exit 130 (seen once in CI). Now the handler only records the
signal and the copy polls for it; these tests hold each half of that to the real sshd.
An upload cut short once left the part it had written under the file's real name.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest
from paramiko.buffered_pipe import BufferedPipe, PipeTimeout
from ssh_fixtures import PYTHON, SshWorld

from meshtrain.hosts import transfer
from meshtrain.hosts.inventory import load_inventory
from meshtrain.hosts.ssh import Shell, connect, sh, shell_line
from meshtrain.hosts.transfer import TransferError, fetch_tree, put_files
from meshtrain.launch.launcher import Interrupted, _stop_on_signals


class Stop(BaseException):
    """What the test's check raises: a BaseException, like the launcher's Interrupted."""


@pytest.fixture
def client(loopback_ssh: SshWorld, tmp_path: Path) -> Iterator[paramiko.SSHClient]:
    inventory = loopback_ssh.inventory(tmp_path / "inv.yaml", [
        {"name": "alpha", "host": "127.0.0.1", "port": loopback_ssh.servers[0].port}])
    ssh = connect(load_inventory(inventory).hosts[0])
    try:
        yield ssh
    finally:
        ssh.close()


def run_directory(tmp_path: Path, megabytes: int) -> Path:
    remote = tmp_path / "remote" / "run-1"
    (remote / "sub").mkdir(parents=True)
    (remote / "metrics.csv").write_text("step,loss\n1,0.5\n")
    with open(remote / "sub" / "model.pt", "wb") as f:
        f.truncate(megabytes << 20)  # tar reads every zero of it
    return remote


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("use_sftp", [False, True], ids=["tar", "sftp"])
def test_a_copy_stops_at_the_first_check_that_raises(client: paramiko.SSHClient, tmp_path: Path,
                                                      use_sftp: bool) -> None:
    """Stopped once part of the 64 MiB file is here: nothing is left, and no thread of
    paramiko's dies on the closed channel (an SFTP prefetch thread still sending its
    requests once printed a traceback)."""
    remote = run_directory(tmp_path, 64)
    local = tmp_path / "local"
    local.mkdir()

    def arrived() -> int:
        return sum(f.stat().st_size for f in local.rglob("*") if f.is_file())

    def check() -> None:
        if arrived() > 1 << 20:
            raise Stop

    with pytest.raises(Stop):
        fetch_tree(client, str(remote), local / "run-1", use_sftp=use_sftp, check_stop=check)
    assert list(local.iterdir()) == []  # nothing half-written, not even the hidden folder

    fetch_tree(client, str(remote), local / "run-1", use_sftp=use_sftp, check_stop=lambda: None)
    assert (local / "run-1" / "metrics.csv").read_text() == "step,loss\n1,0.5\n"
    assert (local / "run-1" / "sub" / "model.pt").stat().st_size == 64 << 20


def test_a_run_directory_of_512_mib_copies_back(client: paramiko.SSHClient, tmp_path: Path) -> None:
    """paramiko rekeyed by itself after 512 MiB received; when the host's tar ended then, its
    channel close arrived during that key exchange and the copy died 30 s later with
    "Key-exchange timed out waiting for key negotiation" (paramiko #822). This size hit it
    every time; connect() now leaves the rekey to OpenSSH's limits."""
    remote = run_directory(tmp_path, 512)
    local = tmp_path / "local"
    local.mkdir()
    fetch_tree(client, str(remote), local / "run-1", use_sftp=False)
    assert (local / "run-1" / "sub" / "model.pt").stat().st_size == 512 << 20


def test_a_host_that_goes_silent_mid_copy_is_an_error(client: paramiko.SSHClient, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's tar is frozen (SIGSTOP) after the copy starts: no byte comes, and after
    STALL_TIMEOUT the copy fails with a message, leaving nothing; the check kept running
    through the stall."""
    monkeypatch.setattr(transfer, "STALL_TIMEOUT", 1.0)
    remote = run_directory(tmp_path, 1024)  # far more than SSH's window and the socket buffers
    local = tmp_path / "local"
    local.mkdir()
    frozen: list[int] = []
    calls: list[float] = []

    def freeze_the_host_tar() -> None:
        calls.append(time.monotonic())
        # Until tar itself is frozen: its shell, stopped a moment before it forks tar, would
        # leave tar free to send everything.
        if not any(Path(f"/proc/{pid}/comm").read_text().strip() == "tar" for pid in frozen):
            found = subprocess.run(["pgrep", "-f", f"tar -C {remote} -cf -"], capture_output=True, text=True)
            for pid in map(int, found.stdout.split()):
                if pid not in frozen:
                    os.kill(pid, signal.SIGSTOP)
                    frozen.append(pid)

    started = time.monotonic()
    try:
        with pytest.raises(TransferError, match=r"^the host sent nothing for 1 s$"):
            fetch_tree(client, str(remote), local / "run-1", use_sftp=False, check_stop=freeze_the_host_tar)
    finally:
        for pid in frozen:  # SIGKILL ends a stopped process too; one may be gone already
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert frozen, "the host's tar was never found"
    assert time.monotonic() - started < 30
    # Polled through the stall (every POLL_SECONDS, so a signal is seen within 0.2 s). A
    # stall's polls are the calls that came at least half a poll after the one before; the
    # reads of bytes tar sent before it froze follow each other at once. 4 on an idle
    # machine in a 1 s stall; a loaded one stretches a poll, never shortens it, so fewer:
    # at least 2 unless each took over 0.5 s. Once this counted every call, data reads
    # included, and asked for more than 5: when tar froze before its first byte there were
    # only the stall's 5 (CI failed).
    polls = [b for a, b in itertools.pairwise(calls) if b - a >= transfer.POLL_SECONDS / 2]
    assert len(polls) >= 2
    assert list(local.iterdir()) == []


def test_a_host_that_never_says_how_its_command_ended_is_an_error(client: paramiko.SSHClient,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Its output closed, its exit status never sent: the wait for that status once had no
    end (a copy-back hung there), and a stop was not seen during it."""
    monkeypatch.setattr(transfer, "STALL_TIMEOUT", 1.0)
    marker = f"mt-never-ends-{os.getpid()}-{time.monotonic_ns()}"
    channel = transfer._exec(client, sh(shell_line("exec", Shell(">&- 2>&-;"), "exec", PYTHON, "-c",
                                                   "import time; time.sleep(600)", marker)))
    try:
        with pytest.raises(TransferError, match=r"^x: the host did not say how it ended within 1 s$"):
            transfer._check_status(channel, "x", lambda: None)
        with pytest.raises(Stop):
            transfer._check_status(channel, "x", stop_now)
    finally:
        channel.close()
        subprocess.run(["pkill", "-f", marker])


def stop_now() -> None:
    raise Stop


def test_the_signal_handler_never_raises_into_the_code_it_interrupts() -> None:
    """A SIGINT that arrives while the main thread waits inside paramiko (the CI failure's
    place) is only recorded; the copy's next check raises it."""
    pipe: BufferedPipe[bytes] = BufferedPipe()
    with _stop_on_signals() as stop:
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(PipeTimeout):
            pipe.read(10, timeout=2.0)  # the handler runs during this wait
        timer.join()
        assert stop.signum == signal.SIGINT
        with pytest.raises(Interrupted, match="SIGINT"):
            stop.check()
    pipe.feed(b"ok")
    assert pipe.read(10, timeout=1.0) == b"ok"  # its lock is intact


def uploaded(folder: Path) -> list[str]:
    """The folder's entries once no upload into it is in flight (the host's shell ends by itself)."""
    deadline = time.monotonic() + 10
    while any(".uploading-" in p.name for p in folder.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("use_sftp", [False, True], ids=["cat", "sftp"])
def test_an_upload_arrives_whole_with_its_mode(client: paramiko.SSHClient, tmp_path: Path,
                                              use_sftp: bool) -> None:
    script = tmp_path / "train.py"
    script.write_bytes(b"print('hi')\n" * 10_000)
    script.chmod(0o750)
    folder = tmp_path / "remote"
    folder.mkdir()
    (folder / "train.py").write_text("an older version")
    put_files(client, str(folder), [script], use_sftp=use_sftp)
    assert uploaded(folder) == ["train.py"]
    assert (folder / "train.py").read_bytes() == script.read_bytes()
    assert (folder / "train.py").stat().st_mode & 0o777 == 0o750


def test_an_upload_cut_short_leaves_no_part_of_it(client: paramiko.SSHClient, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C after the first 64 KiB of 8 MiB: the host's cat sees the end of its input as if
    the file were complete; before, the 64 KiB stood under the file's real name."""
    big = tmp_path / "data.bin"
    big.write_bytes(os.urandom(8 << 20))
    folder = tmp_path / "remote"
    folder.mkdir()
    real_exec = transfer._exec

    def interrupted_after_one_block(ssh: paramiko.SSHClient, command: str) -> paramiko.Channel:
        channel = real_exec(ssh, command)
        sendall = channel.sendall
        sent = 0

        def send(block: bytes) -> None:
            nonlocal sent
            if sent:  # once the host has written what came: the moment that matters
                deadline = time.monotonic() + 10
                while sum(p.stat().st_size for p in folder.iterdir()) < sent and time.monotonic() < deadline:
                    time.sleep(0.01)
                raise KeyboardInterrupt
            sendall(block)
            sent += len(block)
        channel.sendall = send  # type: ignore[method-assign]
        return channel

    monkeypatch.setattr(transfer, "_exec", interrupted_after_one_block)
    with pytest.raises(KeyboardInterrupt):
        put_files(client, str(folder), [big], use_sftp=False)
    assert uploaded(folder) == []


def test_an_sftp_upload_cut_short_leaves_no_part_of_it(client: paramiko.SSHClient, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    big = tmp_path / "data.bin"
    big.write_bytes(os.urandom(1 << 20))
    folder = tmp_path / "remote"
    folder.mkdir()

    def half_then_interrupted(self: paramiko.SFTPClient, source: object, path: str, *args: object,
                              **kwargs: object) -> None:
        with self.open(path, "wb") as remote:
            remote.write(big.read_bytes()[:1000])
        raise KeyboardInterrupt

    monkeypatch.setattr(paramiko.SFTPClient, "putfo", half_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        put_files(client, str(folder), [big], use_sftp=True)
    assert uploaded(folder) == []
