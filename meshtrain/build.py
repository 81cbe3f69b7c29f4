"""From settings to a run ready to train: the spec, the task's model and data, the strategy.

Used by ``meshtrain simulate`` (and each rank of ``meshtrain launch``) and by
:mod:`meshtrain.compare`, so that every way of starting a run resolves settings alike.
"""

from __future__ import annotations

import os
from typing import Any

from meshtrain.config import (
    ConfigError,
    RunSpec,
    build_strategy,
    load_profile,
    parse_set,
    resolve_spec,
    strategy_class,
)
from meshtrain.devices import resolve_device
from meshtrain.tasks import TaskOptions, check_options, get_task


def build_run(
    flags: dict[str, Any], overrides: list[str], launched: bool
) -> tuple[RunSpec, Any, Any]:
    """Resolve settings layers into a spec, then build the task and the strategy.

    Layers, later ones winning: RunSpec defaults < the task's suggestions < a profile <
    flags < ``--set``. Every layer is checked against the settings' one definition.
    """
    profile_name = flags.pop("profile", None)
    profile = load_profile(profile_name) if profile_name else {}
    strategy_name = flags.get("strategy") or profile.get("strategy") or RunSpec.strategy
    set_layer = parse_set(overrides, strategy_name)  # bare names (H=50) are this strategy's
    strategy_name = set_layer.get("strategy") or strategy_name
    strategy_class(strategy_name)
    task = get_task(set_layer.get("task") or flags.get("task") or profile.get("task") or RunSpec.task)
    defaults = {**task.defaults, "strategy_options": task.strategy_defaults.get(strategy_name, {})}
    spec = resolve_spec([
        (f"task {task.name!r} defaults: ", defaults),
        (f"profile {profile_name}: ", profile),
        ("", flags),
        ("--set ", set_layer),
    ])
    if launched:
        spec.nodes = int(os.environ["WORLD_SIZE"])
    if spec.data is not None and not task.takes_data:
        raise ConfigError(f"task {task.name!r} reads no data file: drop --data {spec.data}")
    try:
        resolve_device(spec.device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    strategy = build_strategy(spec)
    bundle = task.build(TaskOptions(spec.data, spec.seed, check_options(task, spec.task_options)))
    return spec, bundle, strategy
