"""Running a command on a pseudo-terminal of a given size, as a user at a terminal would."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from collections.abc import Mapping
from pathlib import Path

#: Escape codes a rich display writes (colours, cursor moves, line erases).
ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[()][0-9A-B]|\x1b[=>78]")


def run_on_a_terminal(command: list[str], cwd: Path, env: Mapping[str, str], *, columns: int,
                      lines: int = 50, timeout: float = 240) -> tuple[int, str]:
    """Run ``command`` with stdout and stderr on a pty ``columns`` x ``lines``; its exit
    status and everything it wrote (escape codes included)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
    proc = subprocess.Popen(command, cwd=cwd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                            env=dict(env))
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every writer has closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        proc.kill()
        os.close(master)
    return code, b"".join(chunks).decode(errors="replace")
