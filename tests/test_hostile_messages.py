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
