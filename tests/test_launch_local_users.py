"""Other users on a host: the launch secret and the workdir.

The secret goes into a fresh private folder (0700) in the rank's workdir, into a file
created without following a symlink and only if it does not exist; a symlink or a folder
another user planted at that name is refused and nothing is written through it. A workdir
another user owns, or one other users can write without the sticky bit, is refused
before anything is started. Real sshd on 127.0.0.1; the tests run as root, so "another
user" is uid 65534 (nobody) by chown.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from ssh_fixtures import SshWorld, loopback_world

from meshtrain.comm.rendezvous import SECRET_FILE_ENV, new_secret, take_secret
from meshtrain.hosts.inventory import Host, load_inventory
from meshtrain.hosts.ssh import SSHError, connect
from meshtrain.launch.launcher import (
    LaunchOptions,
    PreflightError,
    deliver_secret,
    preflight,
    secret_file_name,
    secret_folder_name,
)

pytestmark = pytest.mark.slow
NOBODY = 65534


@pytest.fixture(scope="module")
def loopback_ssh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshWorld]:
    yield from loopback_world(tmp_path_factory)


def one_host_inventory(world: SshWorld, tmp_path: Path, workdir: Path) -> Path:
    return world.inventory(tmp_path / "inv.yaml", [
        {"name": "alpha", "host": "127.0.0.1", "port": world.servers[0].port, "workdir": str(workdir)}])


def one_host(world: SshWorld, tmp_path: Path, workdir: Path) -> Host:
    return load_inventory(one_host_inventory(world, tmp_path, workdir)).hosts[0]


def deliver(host: Host, secret: str) -> None:
    """The launcher's secret delivery to ``host`` for run r1, over a real SSH connection."""
    client = connect(host)
    try:
        deliver_secret(client, host, "r1", secret, timeout=10)
    finally:
        client.close()


def test_the_secret_lands_in_a_private_folder_and_the_rank_removes_both(
        loopback_ssh: SshWorld, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    host = one_host(loopback_ssh, tmp_path, workdir)
    secret = new_secret()
    deliver(host, secret)
    folder, file = workdir / secret_folder_name("r1", 0), workdir / secret_file_name("r1", 0)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(file.stat().st_mode) == 0o600
    monkeypatch.chdir(workdir)
    monkeypatch.setenv(SECRET_FILE_ENV, secret_file_name("r1", 0))
    assert take_secret() == secret.encode()
    assert not folder.exists()


def test_a_planted_symlink_at_the_secrets_path_is_refused(loopback_ssh: SshWorld, tmp_path: Path) -> None:
    """Another user who can write the workdir's parent plants a link at the secret
    folder's name, pointing into a folder of theirs: refused, nothing written there."""
    workdir, elsewhere = tmp_path / "work", tmp_path / "attacker"
    workdir.mkdir()
    elsewhere.mkdir(mode=0o777)
    (workdir / secret_folder_name("r1", 0)).symlink_to(elsewhere)
    host = one_host(loopback_ssh, tmp_path, workdir)
    with pytest.raises(SSHError) as info:
        deliver(host, new_secret())
    message = str(info.value)
    assert message.startswith("alpha (root@127.0.0.1:") and "\n" not in message, message
    assert "already exists and is not a private folder of this user's" in message, message
    assert list(elsewhere.iterdir()) == []  # nothing written through the link


def test_a_link_at_the_secret_files_name_is_replaced_not_followed(
        loopback_ssh: SshWorld, tmp_path: Path) -> None:
    """In the private folder an earlier attempt left (only we can write there), whatever is
    at the file's name is removed, never followed, and the secret is written afresh."""
    workdir, elsewhere = tmp_path / "work", tmp_path / "attacker"
    workdir.mkdir()
    elsewhere.mkdir(mode=0o777)
    folder = workdir / secret_folder_name("r1", 0)
    folder.mkdir(mode=0o700)
    (folder / "secret").symlink_to(elsewhere / "stolen")
    host = one_host(loopback_ssh, tmp_path, workdir)
    secret = new_secret()
    deliver(host, secret)
    assert list(elsewhere.iterdir()) == []
    assert not (folder / "secret").is_symlink() and (folder / "secret").read_text() == secret
    assert stat.S_IMODE((folder / "secret").stat().st_mode) == 0o600


def test_the_rank_refuses_a_secret_that_is_a_symlink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / secret_folder_name("r1", 1)
    folder.mkdir(mode=0o700)
    target = tmp_path / "planted"
    target.write_text("x" * 64)
    (folder / "secret").symlink_to(target)
    monkeypatch.setenv(SECRET_FILE_ENV, str(folder / "secret"))
    with pytest.raises(RuntimeError, match="cannot read the launch secret"):
        take_secret()
    folder.chmod(0o755)  # a folder others can read is not private either
    monkeypatch.setenv(SECRET_FILE_ENV, str(folder / "other"))
    with pytest.raises(RuntimeError, match="is not a private folder of this user's"):
        take_secret()


@pytest.mark.parametrize(("owner", "mode", "why"), [
    (NOBODY, 0o755, "is owned by another user (uid 65534)"),
    (None, 0o777, "is writable by other users (mode 777, no sticky bit)"),
    (None, 0o1777, None),  # /tmp-like: the sticky bit stops others replacing our files
])
def test_a_workdir_other_users_control_is_refused(
        loopback_ssh: SshWorld, tmp_path: Path, owner: int | None, mode: int, why: str | None) -> None:
    workdir = tmp_path / "shared"
    workdir.mkdir()
    workdir.chmod(mode)
    if owner is not None:
        os.chown(workdir, owner, owner)
    inv = one_host_inventory(loopback_ssh, tmp_path, workdir)
    if why is None:
        for client in preflight(load_inventory(inv), LaunchOptions(run_id="r1")):
            client.close()
        assert (workdir / "runs").is_dir()
        return
    with pytest.raises(PreflightError) as info:
        preflight(load_inventory(inv), LaunchOptions(run_id="r1"))
    assert info.value.problems == [
        f"alpha (root@127.0.0.1:{loopback_ssh.servers[0].port}): refusing workdir {workdir}: it {why}; "
        "another user could plant files there (use a folder of your own)"]
    assert not (workdir / "runs").exists()  # nothing created in it


def test_the_secret_is_on_no_command_line_and_in_no_environment(
        loopback_ssh: SshWorld, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the ranks run, the launch's secret is in no process's command line or
    environment on the machine (launcher, sshd, shells, ranks): it travels on SSH's stdin
    into the private file only. The file is removed when the launch ends."""
    import threading
    import time

    from meshtrain.launch import launcher

    secret = new_secret()
    monkeypatch.setattr(launcher, "new_secret", lambda: secret)
    marker = f"secret-scan-{secret[:6]}"
    workdir = tmp_path / "work"
    inv = load_inventory(one_host_inventory(loopback_ssh, tmp_path, workdir))
    argv = ["python", "-c", f"import time; time.sleep(4)  # {marker}"]
    ended: dict[str, object] = {}
    runner = threading.Thread(target=lambda: ended.update(result=launcher.launch(
        inv, argv, launcher.LaunchOptions(run_id="scan"), training=False)))
    runner.start()
    try:
        deadline = time.monotonic() + 60
        while not any(marker in _read(p / "cmdline").decode(errors="replace")
                      for p in Path("/proc").iterdir() if p.name.isdigit()):
            assert time.monotonic() < deadline and runner.is_alive(), "the rank never started"
            time.sleep(0.1)
        assert (workdir / secret_file_name("scan", 0)).read_text() == secret  # delivered
        for proc in Path("/proc").iterdir():
            for part in ("cmdline", "environ"):
                if proc.name.isdigit():
                    assert secret.encode() not in _read(proc / part), f"{proc}/{part}"
    finally:
        runner.join(timeout=60)
    assert ended["result"].exit_code == 0  # type: ignore[attr-defined]
    assert not (workdir / secret_folder_name("scan", 0)).exists()


def _read(path: Path) -> bytes:
    """A /proc file's bytes; none when its process has ended since /proc was listed (reading
    once: a check first, then a read, lost that race in CI, ProcessLookupError)."""
    try:
        return path.read_bytes()
    except OSError:
        return b""
