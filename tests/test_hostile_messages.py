"""What the launcher says when a host is slow or breaks, and what an exception's text may
do to the terminal (issue 44, item 13): one line naming the host and what to do, never an
empty ``TimeoutError: `` or a traceback, and no markup or escape sequence of a message's
reaching the terminal as such.

The hosts are the session's loopback sshd (conftest.py); a host's slow interpreter is an
inventory ``python`` that sleeps before it starts the real one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from ssh_fixtures import SshWorld

from meshtrain.hosts.inventory import load_inventory
from meshtrain.launch import launcher
from meshtrain.launch.launcher import LaunchOptions, PreflightError, preflight


def _slow_python(folder: Path, seconds: float) -> Path:
    python = folder / "slow-python"
    python.write_text(f"#!/bin/sh\nsleep {seconds}\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    return python


def _inventory(world: SshWorld, folder: Path, python: Path) -> Path:
    port = world.servers[0].port
    return world.inventory(folder / "inv.yaml", [{"name": "box0", "host": "127.0.0.1", "port": port}],
                           workdir=str(folder / "remote"), python=str(python))


def test_an_interpreter_slower_than_the_connection_timeout_still_passes_preflight(
        loopback_ssh: SshWorld, tmp_path: Path) -> None:
    """A 2 s interpreter against a 1 s connection timeout stands for the 12 s cold start
    against the 10 s default: it failed with ``TimeoutError: `` and nothing after it."""
    inv = load_inventory(_inventory(loopback_ssh, tmp_path, _slow_python(tmp_path, 2)))
    clients = preflight(inv, LaunchOptions(run_id="slow", connect_timeout=1.0))
    for client in clients:
        client.close()


def test_an_interpreter_that_never_starts_is_one_line_naming_the_host(
        loopback_ssh: SshWorld, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "INTERPRETER_START_S", 1.0)
    python = _slow_python(tmp_path, 30)
    inv = load_inventory(_inventory(loopback_ssh, tmp_path, python))
    with pytest.raises(PreflightError) as refused:
        preflight(inv, LaunchOptions(run_id="hung", connect_timeout=1.0))
    assert refused.value.problems == [
        f"box0 (root@127.0.0.1:{loopback_ssh.servers[0].port}): python {python} did not start and check "
        f"workdir {tmp_path / 'remote'} within 1 s: the interpreter hangs or its disk does not answer "
        "(run it there by hand)"]


# --------------------------------------------------------------------------- what reaches the terminal
HOSTILE_TEXT = "node 1 said [/] [bold]loud[/bold] \x1b]0;pwned\x07\x1b[2J"
SHOWN = "node 1 said [/] [bold]loud[/bold] \\x1b]0;pwned\\x07\\x1b[2J"


def test_markup_and_escape_sequences_in_a_failure_reach_the_terminal_as_text(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A node's exception text went through rich markup: "[/]" crashed the report with a
    MarkupError, "[bold]" styled it, and ESC sequences retitled and cleared the terminal."""
    from types import SimpleNamespace

    from meshtrain.cli.main import _report_failure
    from meshtrain.errors import RunFailure

    job = SimpleNamespace(run_dir=None, checkpoints=None)
    _report_failure(RunFailure(HOSTILE_TEXT), job, verbose=False)
    assert capsys.readouterr().err == f"error: {SHOWN}\n"
    _report_failure(ValueError(HOSTILE_TEXT), job, verbose=False)
    assert capsys.readouterr().err == f"error: ValueError: {SHOWN}\n"


def test_fail_writes_escape_sequences_out(capsys: pytest.CaptureFixture[str]) -> None:
    from meshtrain.cli.console import fail

    assert fail(f"{HOSTILE_TEXT}\nsecond line").exit_code == 2
    assert capsys.readouterr().err == f"error: {SHOWN}\nsecond line\n"


def test_a_finished_run_whose_copy_back_failed_is_not_told_to_resume(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank finished, then the copy-back hit a full disk: the launcher printed
    `--resume RUN`, which a finished run cannot do. It says where the run is instead (the
    copy-back's own line, test_launch_faults.py)."""
    from in_process import meshtrain_here

    from meshtrain.launch import launcher  # the command imports launch from here when it runs
    from meshtrain.launch.launcher import LaunchResult

    def finished_but_not_copied(*args: object, **kwargs: object) -> LaunchResult:
        return LaunchResult(1, [], None, 3.0, copy_failed=True, world_size=2)

    monkeypatch.setattr(launcher, "launch", finished_but_not_copied)
    inv = tmp_path / "inv.yaml"
    inv.write_text("defaults: {user: nobody, python: /usr/bin/python3}\n"
                   "hosts: [{name: box0, host: 192.0.2.1}, {name: box1, host: 192.0.2.2}]\n")
    done = meshtrain_here("launch", str(inv), "--task", "digits", "--steps", "2", "--checkpoint-every", "1",
                          "--run-id", "done-run", "--out", str(tmp_path / "runs"), "--no-progress",
                          cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "--resume" not in done.stdout + done.stderr
    assert "all 2 ranks finished in 3.0 s, but the run directory was not copied back" in done.stdout


def test_an_upload_the_host_refuses_is_one_line_naming_the_host_and_file(
        loopback_ssh: SshWorld, tmp_path: Path) -> None:
    """A folder of the script's name in the host's workdir makes SFTP's rename fail
    ("Failure"): the launcher printed a 50-line traceback."""
    from in_process import meshtrain_here

    script = tmp_path / "job.py"
    script.write_text("print('ran')\n")
    (tmp_path / "remote" / "job.py" / "in-the-way").mkdir(parents=True)
    inv = _inventory(loopback_ssh, tmp_path, Path(sys.executable))
    done = meshtrain_here("launch", str(inv), "--run-id", "up-1", "--out", str(tmp_path / "runs"), "--plain",
                          "--upload", str(script), "--", "python", "job.py", cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    port = loopback_ssh.servers[0].port
    assert (f"error: box0 (root@127.0.0.1:{port}): cannot upload job.py into {tmp_path / 'remote'}: "
            in done.stderr), done.stderr
    assert "Traceback" not in done.stdout + done.stderr and "ran" not in done.stdout
    assert len(done.stderr.strip().splitlines()) == 2, done.stderr  # the line, and "nothing was started"
