"""A launch from a command's options to the launcher and back, as library calls: what
``meshtrain launch`` and ``meshtrain up`` both run.

:func:`prepare_launch` checks everything it can here, before any host is contacted (bad
input raises :class:`~meshtrain.errors.InputError`): the launcher's options, the run id,
the inventory, the training settings resolved once by the one resolver (``--strategy
auto`` planned from the hosts' cluster file), the data and model to ship, ``--out`` and a
resume's compatibility; it writes the settings file every rank receives.
:func:`finish_launch` tidies up after :func:`~meshtrain.launch.launcher.launch` returns.
The command prints; nothing here does.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from meshtrain import yaml12
from meshtrain.build import AUTO, resolve_run
from meshtrain.checkpoint import fewer_nodes_refusal
from meshtrain.cluster import get_cluster, probe_label
from meshtrain.config.launching import LaunchSettings
from meshtrain.config.resume import resume_conflict
from meshtrain.config.settings import check_flag, check_run_id
from meshtrain.config.spec import ConfigError, RunSpec, load_settings_file, settings_file_text
from meshtrain.config.strategy_options import build_strategy
from meshtrain.engine.balance import check_strategy as check_strategy_balance
from meshtrain.errors import InputError, SettingError
from meshtrain.hosts.bench import BenchError, parse_size
from meshtrain.hosts.inventory import Inventory, load_inventory
from meshtrain.hosts.safe_copy import CopyLimits
from meshtrain.hosts.shipping import ShipError, Shipment, hash_path
from meshtrain.launch.launcher import LaunchOptions, LaunchResult, new_launch_id, training_argv
from meshtrain.planning import Plan, Workload, recommend, trainable_parameters
from meshtrain.run_dir import atomic_write_text
from meshtrain.strategies import STRATEGIES
from meshtrain.tasks import Task, TaskOptions, check_options


@dataclass
class PreparedLaunch:
    """A launch checked and ready to start: what every host runs, and how."""

    inventory: Inventory
    argv: list[str]
    options: LaunchOptions
    training: bool
    how: LaunchSettings
    #: The strategy named on the command line (None: from a profile or --set), for labels.
    strategy: str | None = None
    #: The resolved settings every rank trains with (a training launch only).
    spec: RunSpec | None = None
    settings_file: Path | None = None
    #: ``--strategy auto``'s choice and reasons.
    plan: Plan | None = None
    #: The base model as this machine names it (its own folder or a hub id), when the
    #: ranks load a shipped copy whose path only they have: the copied-back model names this.
    base_model: str | None = None

    @property
    def checkpoint_every(self) -> int | None:
        return self.spec.checkpoint_every if self.spec is not None else None


def prepare_launch(inventory: Path, command: list[str] | None, settings: dict[str, Any], *,
                   show_plan: Callable[[Plan], None] = lambda plan: None,
                   note: Callable[[str], None] = lambda line: None) -> PreparedLaunch:
    """Check and resolve a launch of ``inventory``: a training run from ``settings`` (the
    ``launch`` command's options by setting name, ``set_`` its ``--set`` items, ``profile``
    its profile), or ``command`` on every host. ``show_plan`` hears ``--strategy auto``'s
    plan as soon as it is made; ``note`` a line worth showing. Raises InputError (exit 2)
    naming what is wrong; writes only the settings file of a training launch."""
    settings = dict(settings)
    set_: list[str] = list(settings.pop("set_", None) or [])
    how = LaunchSettings.checked({f.name: settings.pop(f.name, None)
                                  for f in dataclasses.fields(LaunchSettings)})
    upload = [Path(f) for f in how.upload]
    run_id, resume, device, threads = (settings.pop(k, None)
                                       for k in ("run_id", "resume", "device", "threads"))
    out = Path(settings.pop("out_dir", None) or RunSpec.out_dir)
    progress = settings.pop("progress", None) is not False
    strategy = settings.get("strategy")
    for flag, value in (("--run-id", run_id), ("--resume", resume)):
        if value is not None:
            check_run_id(value, flag)
    inv = load_inventory(inventory)
    limits = _copy_limits(how.copy_back_limit, how.copy_back_files)
    flags = dict(settings)  # the training settings, resolved here for every rank
    training = not command
    if command is not None and not command:  # `launch inv.yaml --`: a command was meant, none came
        raise InputError("nothing after --: give the command to run on every host (-- python train.py), "
                         "or drop the -- to train with the flags given")
    if command and (resume or how.max_restarts):
        raise InputError("--resume and --max-restarts continue a training run: give training flags, "
                         "not a command after --")
    if resume and run_id and resume != run_id:
        raise InputError(f"--resume {resume} continues that run id: drop --run-id {run_id}")
    if command and (any(v is not None for v in flags.values()) or set_ or device):
        raise InputError("give training flags or a command after --, not both")
    for f in upload:
        if not f.is_file():
            raise InputError(f"--upload {f}: no such file")
    if device:
        inv = dataclasses.replace(inv, hosts=tuple(dataclasses.replace(h, device=device) for h in inv.hosts))
    inv = _apply_overrides(inv, threads, how.heartbeat_timeout)
    if how.elastic and not training:
        raise InputError("--elastic continues a training run: give training flags, not a command after --")
    if how.allow_shrink and not training:
        raise InputError("--allow-shrink continues a training run: give training flags, not a "
                         "command after --")
    _check_out_dir(out)
    plan: Plan | None = None
    spec: RunSpec | None = None
    settings_file: Path | None = None
    base_model: str | None = None
    shipments: list[Shipment] = []
    required: list[tuple[str, str]] = []
    if training:
        if flags.get("strategy") == AUTO:  # chosen here, before any host is contacted
            plan, cluster_file = _plan_launch(inventory, inv, flags, set_, show_plan)
            flags["strategy"] = plan.choice.strategy
            set_ = [*set_, *(f"{k}={v}" for k, v in plan.choice.options.items())]
        else:
            cluster_file = None
        spec, task = _resolve_training(flags, set_, inv.world_size, restarts=bool(resume or how.max_restarts))
        if how.allow_shrink:
            _check_shrink(spec, how.max_restarts)
        if how.elastic:
            _check_elastic(spec, how)
        given_model = spec.task_options.get("model")
        shipments, required = _ship_inputs(spec, task, how.no_ship)
        if any(s.what == "task_options.model" for s in shipments):
            base_model = _base_model_here(str(given_model))
        spec.progress = progress
        if resume:
            _check_resume_here(spec, out, resume, note)
        run_id = resume or run_id or new_launch_id(strategy or "train", inv.world_size, out)
        if cluster_file is not None:  # the ranks project onto it: every workdir gets a copy
            upload = [*upload, cluster_file]
            spec.cluster = cluster_file.name
        settings_file = _settings_file(spec, out, run_id)
        upload = [*upload, settings_file]
        argv = training_argv(["--settings-file", settings_file.name])
        label = strategy or "train"
    else:
        argv, label = list(command or []), "script"
    # The program of a script command is looked up on every host in preflight, unless
    # it is the host's python or a file this launch uploads first.
    program = None if training or argv[0] in ("python", "python3") or \
        Path(argv[0]).name in {f.name for f in upload} else argv[0]
    options = LaunchOptions(
        run_id=resume or run_id or new_launch_id(label, inv.world_size, out), out_dir=out,
        accept_new_host_keys=how.accept_new_host_keys, uploads=list(upload), resume=bool(resume),
        max_restarts=how.max_restarts, restart_wait=how.restart_wait, allow_shrink=how.allow_shrink,
        elastic=how.elastic, rejoin_backoff=how.rejoin_backoff,
        shipments=shipments, required_paths=required, copy_limits=limits, program=program)
    return PreparedLaunch(inv, argv, options, training, how, strategy, spec, settings_file, plan, base_model)


def abandon_launch(prepared: PreparedLaunch) -> None:
    """Nothing was started (a host not ready): a new run leaves no settings file behind."""
    if prepared.settings_file is not None and not prepared.options.resume:
        prepared.settings_file.unlink(missing_ok=True)


def finish_launch(prepared: PreparedLaunch, result: LaunchResult,
                  note: Callable[[str], None] = lambda line: None) -> None:
    """After the launcher: the settings file is kept while the run may be resumed (until
    its run directory is back, whose config.yaml then records the settings, and only if it
    wrote checkpoints); ``--strategy auto``'s plan goes into config.yaml."""
    if not result.started:
        abandon_launch(prepared)
        return
    if prepared.settings_file is not None and (result.run_dir is not None or not prepared.checkpoint_every):
        prepared.settings_file.unlink(missing_ok=True)
    if prepared.plan is not None and result.run_dir is not None:
        record_plan(result.run_dir, prepared.plan)
    if prepared.base_model is not None and result.run_dir is not None:
        _name_base_model(result.run_dir / "model", prepared.base_model, note)


def _base_model_here(model: str) -> str:
    """How the model a run saves should name its base on this machine (see
    :func:`meshtrain.hf.model.base_model_of`); the name as given if that cannot be read."""
    from meshtrain.hf.model import ModelLoadError, base_model_of

    try:
        return base_model_of(model)
    except ModelLoadError:
        return model


def _name_base_model(model_dir: Path, base: str, note: Callable[[str], None]) -> None:
    """Rank 0 saved its adapter naming its shipped base, a path inside its workdir that
    this machine does not have: name the base this launch was given instead."""
    if not model_dir.is_dir():
        return
    from meshtrain.hf.model import ModelLoadError, name_base_model

    try:
        name_base_model(model_dir, base)
    except ModelLoadError as exc:
        note(f"warning: {exc}; the adapter in {model_dir} may not load here")


def _resolve_training(flags: dict[str, Any], overrides: list[str], world_size: int,
                      restarts: bool = False) -> tuple[RunSpec, Task]:
    """The run's settings, resolved here once by the one resolver (exit 2 on any fault)
    before any host is contacted: a bad value must not start ``world_size`` ranks that
    each fail. Every rank receives this spec (:func:`_settings_file`). ``restarts``: the
    ranks may be started again with --resume (--resume, --max-restarts)."""
    try:
        spec, task = resolve_run(flags, overrides, launched=False)
        # As a launched rank sees it: one node per host, simulated faults not allowed.
        config = dataclasses.replace(spec.train_config(), nodes=world_size, runtime="launched")
        if restarts and config.balance:
            raise InputError("--balance cannot be combined with --resume or --max-restarts yet: the shares "
                             "are measured at the start of a run and not kept in checkpoints")
        config.validate()
        strategy = build_strategy(spec)
        strategy.check_nodes(world_size)
        check_strategy_balance(strategy, config.balance)
        check_options(task, spec.task_options)
    except ValueError as exc:  # ConfigError, SettingError, FaultError, TaskError
        raise InputError(str(exc)) from None
    return spec, task


def _plan_launch(inventory: Path, inv: Inventory, flags: dict[str, Any], overrides: list[str],
                 show_plan: Callable[[Plan], None]) -> tuple[Plan, Path | None]:
    """``launch --strategy auto``: the planner's choice for the inventory's hosts, from the
    cluster file ``hosts bench`` wrote for them (``clusters/INVENTORY.yaml``, or ``--set
    cluster=...``) and its compute probe (or ``--set step_seconds=...``). Returns the plan
    and the cluster file the ranks should project onto (None for a named cluster)."""
    try:
        spec, task = resolve_run(flags, overrides, launched=False)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    given = any(item.partition("=")[0].strip() == "cluster" for item in overrides)
    default = Path("clusters") / f"{inventory.stem}.yaml"
    if not given and not default.is_file():
        raise InputError(f"--strategy auto plans from the hosts' measured network: run `meshtrain hosts "
                         f"bench {inventory} --task {task.name}` (it writes {default}), or give --set "
                         "cluster=FILE")
    name = spec.cluster if given else str(default)
    try:
        cluster = get_cluster(name)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    threads = inv.hosts[0].threads if len({h.threads for h in inv.hosts}) == 1 else None
    wanted = probe_label(task.name, spec.batch_size, threads)
    step = spec.step_seconds
    if step is None:
        if cluster.step_seconds is None or cluster.probe != wanted:
            timed = f"its probe timed {cluster.probe}" if cluster.probe else "it has no compute probe"
            threads_flag = f" --threads {threads}" if threads is not None else ""
            raise InputError(f"--strategy auto: {name}: {timed}, this run is {wanted}: run `meshtrain hosts "
                             f"bench {inventory} --task {task.name} --batch-size {spec.batch_size}"
                             f"{threads_flag}`, or give --set step_seconds=S (one step's compute on "
                             "the slowest host)")
        step = cluster.step_seconds
    try:
        bundle = task.build(TaskOptions(spec.data, spec.seed, check_options(task, spec.task_options)))
    except ValueError as exc:
        raise InputError(str(exc)) from None
    plan = recommend(Workload(trainable_parameters(bundle.model), step, inv.world_size), cluster)
    show_plan(plan)
    return plan, (Path(name) if name.endswith((".yaml", ".yml")) else None)


def record_plan(run_dir: Path, plan: Plan) -> None:
    """config.yaml of a launch with ``--strategy auto``: the choice and its reasons under ``plan``."""
    config_file = run_dir / "config.yaml"
    try:
        config = yaml12.read(config_file)
    except (OSError, ValueError, yaml12.YAMLError):  # written by rank 0's host: anything may be there
        return  # nothing usable came back: the copy-back already said why
    if isinstance(config, dict):
        config["plan"] = plan.as_config()
        atomic_write_text(config_file, yaml.safe_dump(config, sort_keys=False))


def _check_shrink(spec: RunSpec, max_restarts: int) -> None:
    """``--allow-shrink`` needs restarts, checkpoints, and a strategy whose checkpoint can
    continue on fewer nodes (see checkpoint.fewer_nodes_refusal); exit 2 otherwise."""
    if max_restarts < 1:
        raise InputError("--allow-shrink continues after a restart: give --max-restarts 1 or more")
    if not spec.checkpoint_every:
        raise InputError("--allow-shrink continues from a checkpoint: give --checkpoint-every")
    refusal = fewer_nodes_refusal(build_strategy(spec))
    if refusal:
        raise InputError(f"--allow-shrink: {refusal}")


def _check_elastic(spec: RunSpec, how: LaunchSettings) -> None:
    """``--elastic`` needs a strategy whose nodes share one global state at each sync (a
    joiner takes it from a peer, the others go on without a lost one) and no work outside
    a step's transaction (meshtrain/engine/elastic.py); exit 2 naming what is refused."""
    if how.allow_shrink:
        raise InputError("--elastic goes on without a lost host by itself: drop --allow-shrink")
    strategy = build_strategy(spec)
    problem = strategy.elastic_problem()
    if problem:
        able = ", ".join(sorted(name for name, cls in STRATEGIES.items() if cls.elastic))
        raise InputError(f"--elastic: strategy {strategy.name} cannot go on without a node: {problem} "
                         f"(it serves {able})")
    config = spec.train_config()
    refused = [("--balance", config.balance), ("--epochs (give --steps)", config.epochs is not None),
               ("--skip-nonfinite", config.skip_nonfinite), ("--precision fp16", config.precision == "fp16")]
    for flag, given in refused:
        if given:  # each is a collective outside a step's transaction (or a share of the data)
            raise InputError(f"--elastic cannot be combined with {flag} yet")


def _local_inputs(spec: RunSpec, task: Task) -> list[tuple[str, str, str]]:
    """(what, setting, path) for what a training run reads from this machine's disk: its
    data, and ``task_options.model`` when that names a local file or folder (not a hub id)."""
    if spec.data and not task.takes_data:  # here, before anything is shipped
        raise InputError(f"task {task.name!r} reads no data file: drop --data {spec.data}")
    found = [("--data", "data", str(spec.data))] if spec.data else []
    model = spec.task_options.get("model")
    if isinstance(model, str) and model and Path(model).expanduser().exists():
        found.append(("task_options.model", "task_options.model", model))
    return found


def _ship_inputs(spec: RunSpec, task: Task, no_ship: bool
                 ) -> tuple[list[Shipment], list[tuple[str, str]]]:
    """Hash the local data and model (exit 2 if unreadable) and point ``spec`` at the
    copies shipped into every workdir: (what to ship, what every host must hold)."""
    inputs = _local_inputs(spec, task)
    if no_ship:  # the same path on every host, checked before starting
        return [], [(what, path) for what, _, path in inputs]
    try:
        shipments = [hash_path(what, Path(path).expanduser()) for what, _, path in inputs]
    except ShipError:
        raise
    for shipment in shipments:
        if not shipment.files:  # every rank would start, then find nothing to read
            raise InputError(f"{shipment.what} {shipment.local}: the folder holds no files")
    if spec.data and task.check_data is not None:  # what every rank would refuse after shipping
        try:
            task.check_data(Path(spec.data), check_options(task, spec.task_options))
        except ValueError as exc:  # TaskError
            raise InputError(str(exc)) from None
    for (_, key, _), shipment in zip(inputs, shipments, strict=True):
        if key == "data":
            spec.data = shipment.remote
        else:
            spec.task_options = {**spec.task_options, "model": shipment.remote}
    return shipments, []


def _check_out_dir(out: Path) -> None:
    """``--out`` must be a folder this user can write (rank 0's run directory and every
    rank's log come back there): checked by writing, before any host is contacted, without
    leaving anything behind."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"--out {out}: {existing} is a file, not a folder")
    try:
        with tempfile.TemporaryDirectory(dir=existing, prefix=".meshtrain-write-test-"):
            pass
    except OSError as exc:
        raise InputError(f"--out {out}: cannot write into {existing} ({exc.strerror or exc})") from None


def _settings_file(spec: RunSpec, out: Path, run_id: str) -> Path:
    """Write the run's resolved settings to ``<out>/<run-id>.settings.yaml``: uploaded
    into every workdir, it is all a rank is told about what to train (no flags, no
    profile to look up there), and it stays here so that ``--resume`` can check a
    continuation before contacting any host. Removed once the run directory is back."""
    path = out / f"{run_id}.settings.yaml"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, settings_file_text(spec, f"resolved by meshtrain launch for run {run_id}"))
    return path


def _check_resume_here(spec: RunSpec, out: Path, run_id: str, note: Callable[[str], None]) -> None:
    """``--resume RUN-ID``: refuse, before any host is contacted, a finished run or
    settings the checkpointed run cannot continue with (simulate's rules: steps, logging
    and how it runs may change; what is trained and how may not). The hosts' checkpoints
    are checked again by every rank."""
    if (out / run_id / "summary.json").is_file():
        raise InputError(f"--resume {run_id}: the run already finished ({out / run_id}); to train it "
                         "further, give --steps above its steps and a new --run-id")
    record = out / f"{run_id}.settings.yaml"
    if not record.is_file():  # launched from another machine or folder: the ranks check
        note(f"note: {record} is missing, so the settings are checked on the hosts")
        return
    try:
        saved = load_settings_file(str(record))
    except ConfigError as exc:
        raise InputError(str(exc)) from None
    conflict = resume_conflict(saved, spec, 0)  # the step is known on the hosts
    if conflict:
        raise InputError(f"--resume {run_id}: {conflict}")


def _apply_overrides(inv: Inventory, threads: int | None, heartbeat_timeout: float | None) -> Inventory:
    """``--threads`` and ``--heartbeat-timeout`` over the inventory's settings (bad value: exit 2)."""
    if threads is not None:
        try:
            check_flag(RunSpec, "threads", threads)  # the setting's own rule
        except SettingError as exc:
            raise InputError(str(exc)) from None
        inv = dataclasses.replace(inv, hosts=tuple(dataclasses.replace(h, threads=threads)
                                                   for h in inv.hosts))
    if heartbeat_timeout is not None:  # checked by LaunchSettings
        inv = dataclasses.replace(inv, rendezvous=dataclasses.replace(
            inv.rendezvous, heartbeat_timeout=heartbeat_timeout))
    return inv


def _copy_limits(size: str, files: int) -> CopyLimits:
    """The caps on the copy-back from --copy-back-limit and --copy-back-files (checked)."""
    try:
        max_bytes = parse_size(size)
    except BenchError:
        raise InputError(f"--copy-back-limit {size!r}: expected a size such as 64GiB or 500MB") from None
    return CopyLimits(max_bytes=max_bytes, max_files=files)
