"""How ``meshtrain launch`` runs a launch, defined once like the training settings.

The inventory says where (hosts, rendezvous), :class:`~meshtrain.config.spec.RunSpec`
what every rank trains; these are the launcher's own options. Each field carries its help,
limits and :class:`~meshtrain.config.settings.Flag`: the ``launch`` command's options are
generated from them, and :meth:`LaunchSettings.checked` applies the limits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshtrain.config.settings import LONG_RUNS, OUTPUT, Flag, check_flag, setting

#: The launcher's panel of help: what concerns the hosts themselves.
HOSTS = "The hosts"
#: Before a restart: how long a host that was cut off may take to answer again.
RESTART_WAIT_S = 120.0
#: With --elastic: the longest wait between two tries to reach a lost host.
REJOIN_BACKOFF_S = 30.0
#: Most files and folders rank 0's host may send back as the run directory.
DEFAULT_MAX_FILES = 100_000


def _launch_flag(names: tuple[str, ...], panel: str) -> Flag:
    return Flag(names, panel, ("launch",))


@dataclass
class LaunchSettings:
    """The options of a launch (not of the training: those are the RunSpec's)."""

    accept_new_host_keys: bool = setting(
        False, "Trust hosts seen for the first time (records their keys in known_hosts; changed keys "
               "are still refused).", flag=_launch_flag(("--accept-new-host-keys",), HOSTS))
    upload: list[str] = setting(None, "Copy a local file into every workdir first (repeatable).",
                                 factory=list, flag=_launch_flag(("--upload",), HOSTS))
    heartbeat_timeout: float | None = setting(
        None, "Stop the run when a rank sends no heartbeat for this many seconds (stopped or hung); "
              "default: the inventory's rendezvous.heartbeat_timeout, else 30.", above=0,
        flag=_launch_flag(("--heartbeat-timeout",), HOSTS))
    no_ship: bool = setting(
        False, "Do not send --data (and a local task_options.model) into every workdir: every host "
               "already holds it at the same path.", flag=_launch_flag(("--no-ship",), HOSTS))
    plain: bool = setting(
        False, "Stream every rank's lines prefixed with host and rank instead of the live panel (one "
               "row per host: step, loss, steps/s, sent, memory, state); always so when the output "
               "is not a terminal.", flag=_launch_flag(("--plain",), OUTPUT))
    copy_back_limit: str = setting(
        "64GiB", "Most bytes rank 0's host may send back as the run directory (e.g. 200GiB); more "
                 "stops the copy.", flag=_launch_flag(("--copy-back-limit",), OUTPUT))
    copy_back_files: int = setting(
        DEFAULT_MAX_FILES, "Most files and folders rank 0's host may send back as the run directory.",
        minimum=1, flag=_launch_flag(("--copy-back-files",), OUTPUT))
    max_restarts: int = setting(
        0, "When a rank fails, start every rank again from the last checkpoint, up to this many times.",
        minimum=0, flag=_launch_flag(("--max-restarts",), LONG_RUNS))
    restart_wait: float = setting(
        RESTART_WAIT_S, "Before a restart, wait this many seconds for a host that was cut off to "
                        "answer again.", above=0, flag=_launch_flag(("--restart-wait",), LONG_RUNS))
    allow_shrink: bool = setting(
        False, "A host still unreachable after --restart-wait is left out: the others continue "
               "without it from the last checkpoint (ddp, diloco, sparta-diloco, fedavg).",
        flag=_launch_flag(("--allow-shrink",), LONG_RUNS))

    elastic: bool = setting(
        False, "A lost host (its rank killed, its link down, silent past --heartbeat-timeout) is dropped "
               "at the next sync and the others go on; the launcher retries it over SSH and its rank "
               "rejoins at an outer sync with a peer's state (ddp, diloco, fedavg, sparta-diloco). "
               "Rank 0's host is not covered: see --max-restarts.",
        flag=_launch_flag(("--elastic",), LONG_RUNS))
    rejoin_backoff: float = setting(
        REJOIN_BACKOFF_S, "With --elastic: most seconds between two tries to reach a lost host again "
                          "(the first after 1 s, then twice as long each time).",
        above=0, flag=_launch_flag(("--rejoin-backoff",), LONG_RUNS))

    @classmethod
    def checked(cls, given: dict[str, Any]) -> LaunchSettings:
        """The settings from ``given`` (None: not given, the default), each checked
        against its type and limits; a :class:`SettingError` names the flag."""
        values = {k: v for k, v in given.items() if v is not None}
        for name, value in values.items():
            check_flag(cls, name, value)
        return cls(**values)
