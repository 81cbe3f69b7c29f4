"""Run a ``meshtrain`` command line inside the test process instead of a new interpreter.

A fresh ``python -m meshtrain`` spends ~3 s (more on a loaded machine) importing torch
before it does anything; the test process has imported it already. The command runs
through the same Typer app as the console script, from ``cwd``, with the same
environment; what it prints to stdout and stderr comes back separately, as from a
subprocess with pipes. In a client network namespace (``netns``) the command runs with this
thread switched into that namespace (``setns``, as ``ip netns exec`` does for a new process):
the sockets it opens, and those of the threads it starts, are that namespace's.

An exception the command does not turn into an exit status is re-raised here (a
subprocess would have printed its traceback and exited 1), so a test cannot mistake it
for an ordinary failure; a command still running after ``timeout`` seconds dumps every
thread's stack and ends the test process, as a hang must not pass quietly.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from typer.testing import CliRunner


def meshtrain_here(*args: str, cwd: Path, timeout: float = 120,
                   netns: str | None = None) -> subprocess.CompletedProcess[str]:
    """``meshtrain ARGS`` run in this process from ``cwd`` (in network namespace ``netns``,
    if given): exit status, stdout, stderr."""
    from meshtrain.cli.main import app

    faulthandler.dump_traceback_later(timeout, exit=True)
    argv_before = sys.argv
    sys.argv = ["meshtrain", *args]  # what a command that echoes its own command line sees
    try:
        with _chdir(cwd), _network_namespace(netns):
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


CLONE_NEWNET = 0x40000000  # <sched.h>


@contextlib.contextmanager
def _network_namespace(name: str | None) -> Iterator[None]:
    """Switch this thread into network namespace ``name`` (``ip netns add NAME``) and back.

    A namespace belongs to each thread: the others (pytest's, xdist's) stay where they are,
    and a thread started inside inherits the namespace, as the launcher's SSH threads must."""
    if name is None:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)

    def enter(fd: int, what: str) -> None:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {what}: {os.strerror(ctypes.get_errno())}")

    with open("/proc/thread-self/ns/net") as here, open(f"/run/netns/{name}") as there:
        enter(there.fileno(), f"network namespace {name}")
        try:
            yield
        finally:
            enter(here.fileno(), "this thread's own network namespace")
