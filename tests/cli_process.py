"""Running the real `meshtrain` entry point in a fresh interpreter (exit codes, stderr)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m meshtrain ARGS`` in ``cwd``, as a user would run it (not a launched rank)."""
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "meshtrain", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
