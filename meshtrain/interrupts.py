"""Who answers Ctrl-C while meshtrain's processes are still starting.

Importing torch and the rest takes 1-4 s, before any of the command's own handlers exist,
and a Ctrl-C then printed a Python traceback of whichever module was loading; so did the
processes runtime's node server, which a terminal's Ctrl-C reaches too, while it preloaded
torch. ``import meshtrain`` runs :func:`quiet_ctrl_c_while_importing` before anything else:

- in the ``meshtrain`` command (its console script, or ``python -m meshtrain`` as launched
  ranks run it), Ctrl-C prints one line and exits 130 until the CLI's imports are done
  (:func:`hand_back_ctrl_c`), and again while a command that computes imports torch where
  it runs (:func:`loading_quietly`: the CLI's own modules load without torch);
- in the node server (multiprocessing's forkserver, which preloads meshtrain), Ctrl-C is
  ignored for good, as the server itself does once its preload is done; its node processes
  inherit that, and the run that started them stops them;
- anywhere else (a program that imports meshtrain as a library, a spawned process: macOS
  starts the nodes so, and they ignore Ctrl-C once their function runs) nothing changes.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

STARTING_INTERRUPTED = "interrupted while starting: nothing was run"


def _started_by_multiprocessing(module: str) -> bool:
    """Whether multiprocessing started this process to run ``multiprocessing.<module>``
    (``python -c 'from multiprocessing.<module> import ...'``)."""
    return any(flag == "-c" and code.startswith(f"from multiprocessing.{module} import")
               for flag, code in itertools.pairwise(sys.orig_argv))


def _is_the_command() -> bool:
    """Whether this process runs the ``meshtrain`` command rather than a user's program."""
    if _started_by_multiprocessing("spawn"):
        return False  # a spawned child is given its parent's sys.argv before it imports
    if sys.argv and Path(sys.argv[0]).name == "meshtrain":
        return True
    # With -m, sys.argv[0] is only "-m" while the package imports; the original has the name.
    return ("-m", "meshtrain") in itertools.pairwise(sys.orig_argv)


def _is_the_node_server() -> bool:
    """Whether this process is a forkserver: meshtrain's processes runtime starts one that
    preloads meshtrain."""
    return _started_by_multiprocessing("forkserver")


def _exit_while_starting(signum: int, frame: FrameType | None) -> None:
    os.write(2, f"{STARTING_INTERRUPTED}\n".encode())
    os._exit(130)  # nothing is open or written yet; unwinding half-run imports helps no one


def quiet_ctrl_c_while_importing() -> None:
    """Set this process's Ctrl-C handling for its start (see the module's docstring)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        return
    if _is_the_node_server():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    elif _is_the_command():
        signal.signal(signal.SIGINT, _exit_while_starting)


def hand_back_ctrl_c() -> None:
    """Ctrl-C raises KeyboardInterrupt again, for the command's own handlers to catch."""
    if signal.getsignal(signal.SIGINT) is _exit_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def loading_quietly() -> Iterator[None]:
    """Around a command's own import of torch and the engine, which the ``meshtrain`` command
    makes in the commands that compute, not at its start: Ctrl-C there is as quiet as while
    the command starts (one line, exit 130; nothing is written yet), and the command's after."""
    quiet_ctrl_c_while_importing()
    try:
        yield
    finally:
        hand_back_ctrl_c()
