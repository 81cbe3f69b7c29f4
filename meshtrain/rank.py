"""Is this process a rank of a launched run? The one place that reads it from the environment.

``meshtrain launch`` (and torchrun) start each rank with RANK and WORLD_SIZE set, the
rendezvous in MASTER_ADDR and MASTER_PORT, and (meshtrain launch only) MESHTRAIN_TIMEOUT,
seconds a collective may wait, and MESHTRAIN_RUN_ID (:func:`environment_run_id`). A
process with RANK and WORLD_SIZE is a launched rank; the Trainer, the launched runtime,
the CLI's settings resolver and the hosts benchmark all ask :func:`launched_rank` rather
than the environment.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from meshtrain.errors import InputError


class RankEnvironmentError(InputError):
    """A launched rank's environment variable that cannot be read: one line naming it."""


@dataclass(frozen=True)
class LaunchedRank:
    """This process's place in a launched run, as its launcher described it."""

    rank: int
    world_size: int
    master_addr: str | None = None
    master_port: int | None = None
    timeout_s: float | None = None  # MESHTRAIN_TIMEOUT: seconds a collective may wait

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
    return LaunchedRank(rank=rank, world_size=world, master_addr=env.get("MASTER_ADDR"),
                        master_port=port, timeout_s=timeout)


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
