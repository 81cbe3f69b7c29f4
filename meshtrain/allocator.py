"""How many malloc arenas this process uses (glibc; a no-op elsewhere).

glibc gives every thread that allocates its own arena, up to eight per core, and an
arena's freed memory mostly stays with it. Simulated nodes are threads that each build
and drop large activations every step, so each extra node kept gigabytes of freed memory:
four whisper-tiny nodes peaked at 12.8-13.7 GB, and at 5.0 GB with ``MALLOC_ARENA_MAX=1``
(identical losses). :func:`limit_malloc_arenas` sets that limit inside the process
(``mallopt(M_ARENA_MAX)``) before the node threads start, and in the environment for
the processes a run starts. A ``MALLOC_ARENA_MAX`` the user set is left as it is (glibc
read it when the process started).
"""

from __future__ import annotations

import ctypes
import os
import sys

ARENAS_ENV = "MALLOC_ARENA_MAX"
#: One arena: the nodes' tensors are large (torch allocates them with mmap or from the
#: shared heap alike), so the lock a single arena costs is not felt, and freed memory is
#: reused by the next node instead of kept per thread.
DEFAULT_ARENAS = 1
_M_ARENA_MAX = -8  # malloc.h


def limit_malloc_arenas(arenas: int = DEFAULT_ARENAS) -> int | None:
    """Limit glibc's malloc to ``arenas`` arenas for this process and its children; the
    limit in force (the user's ``MALLOC_ARENA_MAX`` if set), or None where the C library
    is not glibc (macOS, musl) or refused it. Call it before threads start: glibc fixes
    its limit once a process has more than eight arenas."""
    given = os.environ.get(ARENAS_ENV, "").strip()
    if given:
        return int(given) if given.isdigit() else None
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (only glibc has it; musl's mallopt does nothing)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_ARENA_MAX, arenas) != 1:
        return None
    os.environ[ARENAS_ENV] = str(arenas)  # read by glibc in every process this one starts
    return arenas
