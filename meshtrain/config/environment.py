"""The settings a process reads from its environment, read in this one place.

A launched rank (``meshtrain launch``, or torchrun) is told who it is by torchrun's
variables: RANK and WORLD_SIZE, the rendezvous in MASTER_ADDR and MASTER_PORT. Everything
else a launched rank trains with comes in one resolved settings file, not in variables;
MESHTRAIN_THREADS (a host's thread count from the inventory), MESHTRAIN_RUN_ID and
MESHTRAIN_TIMEOUT (seconds a collective may wait) are what differs per host or per launch;
LOCAL_WORLD_SIZE (torchrun's: the ranks on this machine) shares its cores among them.
A process with RANK and WORLD_SIZE is a launched rank: the Trainer, the launched runtime,
the settings resolver and the hosts benchmark all ask :func:`launched_rank` rather than
the environment.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from meshtrain.config.settings import MAX_THREADS
from meshtrain.errors import SettingError


class RankEnvironmentError(SettingError):
    """A launched rank's environment variable that cannot be read: one line naming it."""


@dataclass(frozen=True)
class LaunchedRank:
    """This process's place in a launched run, as its launcher described it."""

    rank: int
    world_size: int
    master_addr: str | None = None
    master_port: int | None = None
    timeout_s: float | None = None  # MESHTRAIN_TIMEOUT: seconds a collective may wait
    #: MESHTRAIN_ELASTIC: an elastic run's heartbeat (seconds of silence that lose a rank).
    elastic_s: float | None = None
    joining: bool = False  # MESHTRAIN_JOINING=1: started again mid-run, to rejoin

    def rendezvous(self) -> tuple[str, int]:
        """Where the group meets; raises if the launcher did not say."""
        if self.master_addr is None or self.master_port is None:
            missing = [k for k, v in (("MASTER_ADDR", self.master_addr), ("MASTER_PORT", self.master_port))
                       if v is None]
            raise RankEnvironmentError(f"launched rank is missing environment variables: "
                                       f"{', '.join(missing)}")
        return self.master_addr, self.master_port


def launched_rank(environ: Mapping[str, str] | None = None) -> LaunchedRank | None:
    """This process's launched rank (RANK and WORLD_SIZE set), or None when it is not one."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    world = _whole(env, "WORLD_SIZE", 1)
    rank = _whole(env, "RANK", 0)
    if rank >= world:
        raise RankEnvironmentError(f"RANK={rank} is not below WORLD_SIZE={world}")
    port = _whole(env, "MASTER_PORT", 1) if "MASTER_PORT" in env else None
    timeout = None
    if "MESHTRAIN_TIMEOUT" in env:
        try:
            timeout = float(env["MESHTRAIN_TIMEOUT"])
        except ValueError:
            timeout = math.nan
        if not (math.isfinite(timeout) and timeout > 0):
            raise RankEnvironmentError(f"MESHTRAIN_TIMEOUT must be a positive number of seconds, "
                                       f"got {env['MESHTRAIN_TIMEOUT']!r}")
    elastic = _seconds(env, "MESHTRAIN_ELASTIC") if "MESHTRAIN_ELASTIC" in env else None
    return LaunchedRank(rank=rank, world_size=world, master_addr=env.get("MASTER_ADDR"),
                        master_port=port, timeout_s=timeout, elastic_s=elastic,
                        joining=env.get(JOINING_ENV) == "1")


#: Set (to 1) by the launcher on a rank it starts again to rejoin an elastic run.
JOINING_ENV = "MESHTRAIN_JOINING"
#: An elastic run's heartbeat in seconds, set by the launcher on every rank.
ELASTIC_ENV = "MESHTRAIN_ELASTIC"


def _seconds(env: Mapping[str, str], name: str) -> float:
    try:
        value = float(env[name])
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise RankEnvironmentError(f"{name} must be a positive number of seconds, got {env[name]!r}")
    return value


#: The launch's host names in rank order, comma-separated (inventory names have no commas):
#: what a rank's messages name another rank by.
HOST_NAMES_ENV = "MESHTRAIN_HOST_NAMES"


def launched_host_names(world_size: int, environ: Mapping[str, str] | None = None) -> list[str] | None:
    """Every rank's host name (:data:`HOST_NAMES_ENV`, set by the launcher), or None unless it
    names exactly ``world_size`` hosts."""
    env = os.environ if environ is None else environ
    names = env.get(HOST_NAMES_ENV, "").split(",")
    return names if len(names) == world_size and all(names) else None


def environment_run_id(environ: Mapping[str, str] | None = None) -> str | None:
    """MESHTRAIN_RUN_ID, which names a run wherever it is set (a launched rank's launcher
    sets it; a user may too)."""
    env = os.environ if environ is None else environ
    return env.get("MESHTRAIN_RUN_ID")


def _whole(env: Mapping[str, str], name: str, least: int) -> int:
    try:
        value = int(env[name])
    except ValueError:
        value = least - 1
    if value < least:
        raise RankEnvironmentError(f"{name} must be a whole number of at least {least}, got {env[name]!r}")
    return value


def writes_run_directory() -> bool:
    """Whether this process writes the run directory: a simulation does, and of a launched
    run only rank 0."""
    rank = launched_rank()
    return rank is None or rank.rank == 0


def cores_per_local_rank(environ: Mapping[str, str] | None = None) -> int:
    """A launched rank's threads when nothing sets them: the cores this process may run on,
    shared out among the ranks its launcher started on this machine (LOCAL_WORLD_SIZE, as
    torchrun sets it; 1 when unset), at least one each.

    Two ranks on one machine (hosts on loopback, or one big box listed twice) then share
    its cores instead of each starting a thread per core: oversubscribed, OpenMP's threads
    spin waiting for each other (a 2-rank Whisper launch on 2 cores used 89 CPU seconds
    for 20 steps; at one thread each its steps stay at their first speed)."""
    env = os.environ if environ is None else environ
    local = _whole(env, "LOCAL_WORLD_SIZE", 1) if "LOCAL_WORLD_SIZE" in env else 1
    return max(1, usable_cores() // local)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def resolve_threads(threads: int | None, runtime: str) -> int:
    """Intra-op threads per node: explicit, else MESHTRAIN_THREADS, else the runtime's
    default (a launched rank: its machine's cores, shared by its ranks; a simulated node: 1,
    as the nodes share this machine's cores)."""
    if threads is not None:
        return threads
    from_environment = threads_from_environment()
    if from_environment is not None:
        return from_environment
    return cores_per_local_rank() if runtime == "launched" else 1


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
