"""From settings to a run ready to train: the spec, the task's model and data, the strategy.

Used by ``meshtrain simulate`` (and each rank of ``meshtrain launch``) and by
:mod:`meshtrain.compare`, so that every way of starting a run resolves settings alike.
"""

from __future__ import annotations

import copy
from typing import Any

from meshtrain.cluster import get_cluster
from meshtrain.config.environment import launched_rank, resolve_threads
from meshtrain.config.layers import merge, parse_set, resolve_spec
from meshtrain.config.profiles import load_profile
from meshtrain.config.spec import ConfigError, RunSpec, load_settings_file
from meshtrain.config.strategy_options import build_strategy, strategy_class
from meshtrain.devices import resolve_device
from meshtrain.planning import Plan, Workload, probe_compute, recommend, trainable_parameters
from meshtrain.progress import Status
from meshtrain.tasks import Task, TaskBundle, TaskOptions, check_options, get_task

#: ``--strategy auto``: the planner chooses (:func:`choose_strategy`).
AUTO = "auto"


def build_run(
    flags: dict[str, Any], overrides: list[str], launched: bool
) -> tuple[RunSpec, Any, Any]:
    """Resolve settings layers into a spec (:func:`resolve_run`), then build the task and
    the strategy."""
    spec, task = resolve_run(flags, overrides, launched)
    if spec.data is not None and not task.takes_data:
        raise ConfigError(f"task {task.name!r} reads no data file: drop --data {spec.data}")
    try:
        resolve_device(spec.device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if spec.strategy == AUTO:
        if launched:
            raise ConfigError("--strategy auto times the model on this machine: run `meshtrain plan` "
                              "and launch with the strategy it chooses")
        bundle = task.build(TaskOptions(spec.data, spec.seed, check_options(task, spec.task_options),
                                        build_status(spec)))
        choose_strategy(spec, task, bundle)
        return spec, bundle, build_strategy(spec)
    strategy = build_strategy(spec)
    bundle = task.build(TaskOptions(spec.data, spec.seed, check_options(task, spec.task_options),
                                        build_status(spec)))
    return spec, bundle, strategy


def build_status(spec: RunSpec) -> Status:
    """Lines for the task's slow phases: where the run shows progress, on rank 0 only
    (every launched rank builds the task; one voice is enough)."""
    place = launched_rank()
    return Status(enabled=spec.progress and (place is None or place.rank == 0))


def resolve_run(flags: dict[str, Any], overrides: list[str], launched: bool) -> tuple[RunSpec, Task]:
    """The checked spec of a run, and its task, from settings layers; nothing is built.

    Layers, later ones winning: RunSpec defaults < the task's suggestions < a profile <
    flags < ``--set``. Every layer is checked against the settings' one definition.
    ``flags`` holds the command's options (None: not given); its ``profile`` names the profile.
    """
    flags = dict(flags)
    settings_file = flags.pop("settings_file", None)
    if settings_file is not None:
        return _resolve_settings_file(str(settings_file), flags, overrides, launched)
    auto = flags.get("strategy") == AUTO
    if auto:  # resolved as a DDP run; build_run puts the planner's choice in its place
        flags["strategy"] = "ddp"
        for item in overrides:
            key = item.partition("=")[0].strip()
            if key.split(".")[0] not in RunSpec.field_names() or key.startswith("strategy"):
                raise ConfigError(f"--set {key}: --strategy auto chooses the strategy and its "
                                  "parameters itself; drop it, or name a strategy")
    profile_name = flags.pop("profile", None)
    profile = load_profile(profile_name) if profile_name else {}
    chosen = _not_auto(flags.get("strategy") or profile.get("strategy"))
    set_layer = parse_set(overrides, chosen or RunSpec.strategy)  # bare names (H=50) are its
    task = get_task(set_layer.get("task") or flags.get("task") or profile.get("task") or RunSpec.task)
    strategy_name = chosen or task.defaults.get("strategy") or RunSpec.strategy
    if strategy_name != (chosen or RunSpec.strategy):  # the task's strategy: H=50 means its H
        set_layer = parse_set(overrides, strategy_name)
    strategy_name = set_layer.get("strategy") or strategy_name
    _not_auto(strategy_name)
    strategy_class(strategy_name)
    spec = resolve_spec([
        (f"task {task.name!r} defaults: ", task_suggestions(task, strategy_name)),
        (f"profile {profile_name}: ", profile),
        ("", flags),
        ("--set ", set_layer),
    ])
    place = launched_rank() if launched else None
    if place is not None:
        spec.nodes = place.world_size
    if auto:
        spec.strategy, spec.strategy_options = AUTO, {}
    return spec, task


def _not_auto(strategy: str | None) -> str | None:
    """``strategy``, unless it is auto from a profile or ``--set``: only the flag asks the
    planner, which plans before the layers are resolved."""
    if strategy == AUTO:
        raise ConfigError("strategy auto is planned from the --strategy flag: give --strategy auto "
                          "on the command line rather than in a profile or --set")
    return strategy


def _resolve_settings_file(path: str, flags: dict[str, Any], overrides: list[str],
                           launched: bool) -> tuple[RunSpec, Task]:
    """A launched rank's settings: the spec ``meshtrain launch`` resolved once (a settings
    file), under what is given per rank (device, output folder, run id, resume point).
    Nothing is resolved again: no task suggestions, profile or ``--set``."""
    if overrides or flags.pop("profile", None):
        raise ConfigError(f"--settings-file {path} holds every setting: drop --profile and --set")
    spec = resolve_spec([(f"settings file {path}: ", load_settings_file(path)), ("", flags)])
    rank = launched_rank() if launched else None
    if rank is not None:
        spec.nodes = rank.world_size
    return spec, get_task(spec.task)


def choose_strategy(spec: RunSpec, task: Task, bundle: TaskBundle, runtime: str | None = None) -> Plan:
    """``--strategy auto``: the planner's choice for this model on ``spec.cluster`` with
    ``spec.nodes`` hosts (:mod:`meshtrain.planning`), written into ``spec`` (strategy, its
    options over the task's suggestions for it) and recorded under ``extra_config["plan"]``
    with the compute probe (its threads and spread, and a warning when it was noisy).

    The model is timed with the threads each node of the run will use: ``spec.threads``,
    else ``runtime``'s default (default: ``spec.runtime``'s; a plan for hosts passes
    "launched")."""
    cluster = get_cluster(spec.cluster)
    step, probe = spec.step_seconds, None
    if step is None:  # time a throwaway copy: the run must start from the untouched model
        # with the thread count each of the run's nodes will compute with
        threads = resolve_threads(spec.threads, runtime or spec.runtime)
        probe = probe_compute(copy.deepcopy(bundle.model), bundle.train_data, spec.batch_size,
                              bundle.collate_fn, threads=threads, device=resolve_device(spec.device))
        step = probe.seconds / cluster.speed
    plan = recommend(Workload(trainable_parameters(bundle.model), step, spec.nodes), cluster)
    spec.strategy = plan.choice.strategy
    spec.strategy_options = merge(task_suggestions(task, spec.strategy)["strategy_options"],
                                  plan.choice.options)
    recorded = plan.as_config()
    if probe is not None:
        recorded["probe"] = probe.as_config()
        if probe.warning():
            recorded["warnings"] = [probe.warning()]
    spec.extra_config = {**spec.extra_config, "plan": recorded}
    return plan


def task_suggestions(task: Task, strategy: str) -> dict[str, Any]:
    """The settings ``task`` suggests for a run with ``strategy``.

    The strategy options it suggests are its ``strategy_defaults[strategy]`` on top of the
    ``strategy_options`` in its ``defaults``; those belong to the strategy its defaults
    suggest (RunSpec's when they name none), so another strategy does not get them.
    """
    suggested = {k: v for k, v in task.defaults.items() if k != "strategy_options"}
    own = task.defaults.get("strategy_options", {}) \
        if task.defaults.get("strategy", RunSpec.strategy) == strategy else {}
    suggested["strategy_options"] = merge(own, task.strategy_defaults.get(strategy, {}))
    return suggested
