"""Run a ``meshtrain`` command line inside the test process instead of a new interpreter.

A fresh ``python -m meshtrain`` spends ~3 s (more on a loaded machine) importing torch
before it does anything; the test process has imported it already. The command runs
through the same Typer app as the console script, from ``cwd``, with the same
environment; what it prints to stdout and stderr comes back separately, as from a
subprocess with pipes. Only for commands the launcher runs in the root namespace (a
client network namespace needs ``ip netns exec``: use ssh_fixtures.meshtrain there).

An exception the command does not turn into an exit status is re-raised here (a
subprocess would have printed its traceback and exited 1), so a test cannot mistake it
for an ordinary failure; a command still running after ``timeout`` seconds dumps every
thread's stack and ends the test process, as a hang must not pass quietly.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from typer.testing import CliRunner


def meshtrain_here(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``meshtrain ARGS`` run in this process from ``cwd``: exit status, stdout, stderr."""
    from meshtrain.cli.main import app

    faulthandler.dump_traceback_later(timeout, exit=True)
    argv_before = sys.argv
    sys.argv = ["meshtrain", *args]  # what a command that echoes its own command line sees
    try:
        with _chdir(cwd):
            result = CliRunner().invoke(app, list(args), catch_exceptions=True)
    finally:
        sys.argv = argv_before
        faulthandler.cancel_dump_traceback_later()
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["meshtrain", *args], result.exit_code, result.stdout, result.stderr)


@contextlib.contextmanager
def _chdir(folder: Path) -> Iterator[None]:
    """``contextlib.chdir`` (Python 3.11+) for Python 3.10 too."""
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)
