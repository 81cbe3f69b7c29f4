"""How a copy-back stops: when the launcher asks (a signal), or when the host goes silent.

The launcher's signal handler once raised its exception wherever the main thread was. A
Ctrl-C that landed inside paramiko's wait for bytes (between a Condition's wait and its
lock's re-acquire) broke that lock, and the launch died with "release unlocked lock"
and exit 1 instead of exit 130 (seen once in CI). Now the handler only records the
signal and the copy polls for it; these tests hold each half of that to the real sshd.
"""

from __future__ import annotations

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
from ssh_fixtures import SshWorld

from meshtrain.hosts import transfer
from meshtrain.hosts.inventory import load_inventory
from meshtrain.hosts.ssh import connect
from meshtrain.hosts.transfer import TransferError, fetch_tree
from meshtrain.launch.launcher import CopyInterrupted, _stop_on_signals


class Stop(BaseException):
    """What the test's check raises: a BaseException, like the launcher's CopyInterrupted."""


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


@pytest.mark.parametrize("use_sftp", [False, True], ids=["tar", "sftp"])
def test_a_copy_stops_at_the_first_check_that_raises(client: paramiko.SSHClient, tmp_path: Path,
                                                      use_sftp: bool) -> None:
    remote = run_directory(tmp_path, 64)
    local = tmp_path / "local"
    local.mkdir()
    calls = 0

    def check() -> None:
        nonlocal calls
        calls += 1
        if calls == 20:  # well inside the 64 MiB file
            raise Stop

    with pytest.raises(Stop):
        fetch_tree(client, str(remote), local / "run-1", use_sftp=use_sftp, check_stop=check)
    assert calls == 20
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
    STALL_TIMEOUT the copy fails with a message, leaving nothing; the check kept running."""
    monkeypatch.setattr(transfer, "STALL_TIMEOUT", 1.0)
    remote = run_directory(tmp_path, 1024)  # far more than SSH's window and the socket buffers
    local = tmp_path / "local"
    local.mkdir()
    frozen: list[int] = []
    calls = 0

    def freeze_the_host_tar() -> None:
        nonlocal calls
        calls += 1
        if not frozen:
            found = subprocess.run(["pgrep", "-f", f"tar -C {remote} -cf -"], capture_output=True, text=True)
            for pid in found.stdout.split():
                os.kill(int(pid), signal.SIGSTOP)
                frozen.append(int(pid))

    started = time.monotonic()
    try:
        with pytest.raises(TransferError, match=r"^the host sent nothing for 1 s$"):
            fetch_tree(client, str(remote), local / "run-1", use_sftp=False, check_stop=freeze_the_host_tar)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)
    assert frozen, "the host's tar was never found"
    assert time.monotonic() - started < 30
    assert calls > 5  # polled while waiting: a signal would have been seen within 0.2 s
    assert list(local.iterdir()) == []


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
        with pytest.raises(CopyInterrupted, match="SIGINT"):
            stop.check()
    pipe.feed(b"ok")
    assert pipe.read(10, timeout=1.0) == b"ok"  # its lock is intact
