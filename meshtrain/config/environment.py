"""The settings a process reads from its environment, read in this one place.

A launched rank (``meshtrain launch``, or torchrun) is told who it is by torchrun's
variables: RANK and WORLD_SIZE (MASTER_ADDR and MASTER_PORT are read where the group is
joined). Everything else a launched rank trains with comes in one resolved config file,
not in variables; MESHTRAIN_THREADS (a host's thread count from the inventory),
MESHTRAIN_RUN_ID and MESHTRAIN_TIMEOUT are what differs per host or per launch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from meshtrain.config.settings import MAX_THREADS
from meshtrain.errors import SettingError


@dataclass(frozen=True)
class LaunchedRank:
    """This process's place in a launched run."""

    rank: int
    world_size: int


def launched_rank() -> LaunchedRank | None:
    """This process's rank and world size when it is a launched rank (RANK and WORLD_SIZE
    set), else None: the one place that decides "am I a launched rank?"."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        return LaunchedRank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    except ValueError:
        raise SettingError(f"RANK={os.environ['RANK']!r} and WORLD_SIZE={os.environ['WORLD_SIZE']!r} "
                           "must be whole numbers") from None


def writes_run_directory() -> bool:
    """Whether this process writes the run directory: a simulation does, and of a launched
    run only rank 0."""
    rank = launched_rank()
    return rank is None or rank.rank == 0


def threads_from_environment() -> int | None:
    """MESHTRAIN_THREADS, checked (a bad value names the variable), or None when unset."""
    text = os.environ.get("MESHTRAIN_THREADS")
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_THREADS:
        raise SettingError(f"MESHTRAIN_THREADS must be a whole number from 1 to {MAX_THREADS}, "
                           f"got {text!r}")
    return value
