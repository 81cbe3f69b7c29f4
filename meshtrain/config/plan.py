"""The options of ``meshtrain plan``, defined once like the training settings: each field
carries its help, limits and :class:`~meshtrain.config.settings.Flag`, the command's options
are generated from them and :func:`~meshtrain.config.settings.from_flags` applies the limits.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.config.settings import OPTIONS, Flag, setting

PLAN = "plan"
#: Share of a step that may go to communication before a cheaper strategy is chosen.
COMM_BUDGET = 0.10


def _flag(*names: str) -> Flag:
    return Flag(names, OPTIONS, (PLAN,))


@dataclass
class PlanSettings:
    """``meshtrain plan``: the hosts, cluster and task planned for."""

    hosts: int = setting(2, "Hosts that will train (one rank each).", minimum=1, flag=_flag("--hosts", "-n"))
    cluster: str = setting("gbe", "Named cluster (meshtrain clusters) or a cluster file from "
                                  "`meshtrain hosts bench`.", flag=_flag("--cluster"))
    task: str = setting("digits", "Task whose model is planned for.", flag=_flag("--task", "-t"))
    data: str | None = setting(None, "Data file or folder the task reads.", flag=_flag("--data"))
    batch_size: int | None = setting(None, "Samples per host per step (default: the task's).", minimum=1,
                                     flag=_flag("--batch-size"))
    step_seconds: float | None = setting(
        None, "One step's compute on one host, if you know it (default: measured here, divided by "
              "the cluster's speed).", above=0, flag=_flag("--step-seconds"))
    budget: float = setting(COMM_BUDGET, "Share of a step that may go to communication before a "
                                         "cheaper strategy is chosen (1: never).", above=0, maximum=1,
                            flag=_flag("--budget"))
