"""A long command meshtrain runs on a host ends when meshtrain's connection closes.

Without a pty, sshd leaves a command running after its connection closes. A Ctrl-C during
``meshtrain hosts setup`` once waited for every host's pip install to finish (the worker
threads were joined) and, killed, left those installs running on the hosts, where the
next setup's pip would race them in the same venv.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import paramiko
import pytest
from ssh_fixtures import PYTHON, SshWorld, start_meshtrain

from meshtrain.hosts.inventory import load_inventory
from meshtrain.hosts.ssh import Shell, connect, run, sh, shell_line

BASE_PYTHON = "/usr/bin/python3"


def host_processes(marker: str) -> list[str]:
    return subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()


def wait_for(condition: Callable[[], object], seconds: float) -> bool:
    """Whether ``condition`` came true within ``seconds`` (polled)."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(condition())


@pytest.fixture
def inventory(loopback_ssh: SshWorld, tmp_path: Path) -> Path:
    return loopback_ssh.inventory(tmp_path / "inv.yaml", [
        {"name": "alpha", "host": "127.0.0.1", "port": loopback_ssh.servers[0].port}],
        workdir=str(tmp_path / "remote"), python=BASE_PYTHON)


@pytest.fixture
def client(inventory: Path) -> Iterator[paramiko.SSHClient]:
    ssh = connect(load_inventory(inventory).hosts[0])
    try:
        yield ssh
    finally:
        ssh.close()


@pytest.mark.parametrize("hang_up", [True, False])
def test_a_command_ends_with_its_connection_only_under_hang_up(client: paramiko.SSHClient,
                                                               hang_up: bool) -> None:
    marker = f"mt-hang-up-{uuid.uuid4().hex[:10]}"
    command = sh(shell_line(PYTHON, "-c", "import time; time.sleep(600)", marker))
    threading.Thread(target=lambda: run(client, command, timeout=700, hang_up=hang_up), daemon=True).start()
    assert wait_for(lambda: host_processes(marker), 20), "the command never started"
    client.close()
    try:
        assert wait_for(lambda: not host_processes(marker), 10) == hang_up
    finally:
        subprocess.run(["pkill", "-f", marker])


def test_under_hang_up_stderr_comes_with_stdout_and_the_status_is_kept(client: paramiko.SSHClient) -> None:
    result = run(client, sh(shell_line("echo", "out", Shell("; echo err >&2; exit 3"))), hang_up=True)
    assert result.status == 3
    assert result.stdout.splitlines() == ["out", "err"]  # the pty's \r\n read as lines
    assert result.stderr == ""
    with pytest.raises(ValueError, match="no stdin"):
        run(client, "cat", stdin=b"x", hang_up=True)


def test_ctrl_c_during_hosts_setup_stops_every_host_at_once(loopback_ssh: SshWorld, inventory: Path,
                                                            tmp_path: Path) -> None:
    """The host's base python makes a venv whose pip never ends; Ctrl-C once it runs."""
    if not Path(BASE_PYTHON).is_file():
        pytest.skip(f"{BASE_PYTHON} (the host's base interpreter) is not installed")
    marker = f"mt-hanging-pip-{uuid.uuid4().hex[:10]}"
    fake = tmp_path / "python3"
    fake.write_text(f"""#!/bin/sh
case "$1 $2" in
  "-m venv") for last; do :; done; mkdir -p "$last/bin" && cp "$0" "$last/bin/python" ;;
  "-m pip") exec {BASE_PYTHON} -c "import time; time.sleep(600)" {marker} ;;
  *) exec {BASE_PYTHON} "$@" ;;
esac
""")
    fake.chmod(0o755)
    before = inventory.read_text()
    proc = start_meshtrain(loopback_ssh, "hosts", "setup", str(inventory), "--base-python", str(fake),
                           cwd=tmp_path)
    try:
        assert wait_for(lambda: host_processes(marker) or proc.poll() is not None, 120)
        assert proc.poll() is None, proc.communicate()[0]
        proc.send_signal(signal.SIGINT)
        sent_at = time.monotonic()
        output, _ = proc.communicate(timeout=30)
        elapsed = time.monotonic() - sent_at
    finally:
        proc.kill()
        if not wait_for(lambda: not host_processes(marker), 10):
            subprocess.run(["pkill", "-f", marker])
            pytest.fail("the host's pip went on after the setup was interrupted")
    assert proc.returncode == 130, output
    assert elapsed < 5, output
    assert (f"interrupted: setup stopped on every host, {inventory} not changed; run `meshtrain hosts setup` "
            "again to finish") in output, output
    assert "Traceback" not in output
    assert inventory.read_text() == before
