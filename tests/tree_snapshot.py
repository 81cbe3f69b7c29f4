"""What a folder holds, to prove that something outside a run directory did not change."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def snapshot(root: Path, *, mtimes: bool = True) -> dict[str, tuple[int, int, bytes | str | None]]:
    """Every path under ``root``: mode, mtime (0 without ``mtimes``: a folder that had
    something made and removed in it keeps its contents, not its mtime) and contents (or
    link target)."""
    seen: dict[str, tuple[int, int, bytes | str | None]] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            st = path.lstat()
            content: bytes | str | None = None
            if stat.S_ISLNK(st.st_mode):
                content = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                content = path.read_bytes()
            seen[str(path.relative_to(root))] = (st.st_mode, st.st_mtime_ns if mtimes else 0, content)
    return seen
