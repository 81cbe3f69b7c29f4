"""``meshtrain hosts check`` and ``meshtrain launch``: the real-machines commands.

``register(app)`` adds them to the main ``meshtrain`` app. Bad input (inventory, flags,
a host that is not ready) prints one line and exits 2; a rank that fails exits 1; a
launcher stopped by Ctrl-C or SIGTERM exits 130 or 143 after stopping every rank.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import typer
import yaml
from rich.table import Table
from rich.text import Text

from meshtrain import yaml12
from meshtrain.build import AUTO, resolve_run
from meshtrain.checkpoint import fewer_nodes_refusal
from meshtrain.cli import dashboard as dashboard_cli
from meshtrain.cli.console import errors, fail, fail_on
from meshtrain.cli.console import wide_console as console  # the hosts commands' output
from meshtrain.cli.flags import takes_options, takes_settings
from meshtrain.cli.hosts_setup import hosts_setup
from meshtrain.cli.plan import plan_table
from meshtrain.cluster import get_cluster, probe_label
from meshtrain.config.hosts import (
    BENCH,
    CHECK,
    DISCOVER,
    HostsBenchSettings,
    HostsCheckSettings,
    HostsDiscoverSettings,
)
from meshtrain.config.launching import LaunchSettings
from meshtrain.config.resume import resume_conflict
from meshtrain.config.settings import Options, SettingError, check_flag, check_run_id, from_flags
from meshtrain.config.spec import ConfigError, RunSpec, load_settings_file, settings_file_text
from meshtrain.config.strategy_options import build_strategy
from meshtrain.engine.balance import check_strategy as check_strategy_balance
from meshtrain.errors import InputError
from meshtrain.hosts import discovery as d
from meshtrain.hosts.bench import BenchError, model_seconds, parse_size
from meshtrain.hosts.checks import CHECKS, check_hosts
from meshtrain.hosts.inventory import Inventory, InventoryError, load_inventory
from meshtrain.hosts.safe_copy import CopyLimits
from meshtrain.hosts.shipping import ShipError, Shipment, hash_path
from meshtrain.launch.benchmark import BenchmarkFailed, benchmark_hosts, probe_note
from meshtrain.launch.launcher import (
    LaunchOptions,
    PreflightError,
    RankFailure,
    launch,
    new_launch_id,
    training_argv,
)
from meshtrain.launch.live import rank_output
from meshtrain.planning import Plan, Workload, recommend, trainable_parameters
from meshtrain.progress import human_bytes
from meshtrain.run_dir import atomic_write_text
from meshtrain.tasks import Task, TaskOptions, check_options


def resume_command(args: list[str], run_id: str) -> str:
    """The command line that continues ``run_id``: this one, with ``--resume RUN_ID`` in
    place of any ``--run-id``/``--resume`` it had."""
    kept: list[str] = []
    skip = False
    for word in args:
        if skip:
            skip = False
        elif word in ("--run-id", "--resume"):
            skip = True
        elif not word.startswith(("--run-id=", "--resume=")):
            kept.append(word)
    return shlex.join(["meshtrain", *kept, "--resume", run_id])


def _inventory(path: Path) -> Inventory:
    try:
        return load_inventory(path)
    except InventoryError as exc:
        raise fail_on(exc) from None


@takes_options(HostsCheckSettings, CHECK)
def hosts_check(
    inventory: Path = typer.Argument(..., help="Inventory file (hosts/NAME.yaml)."),
    **options: Any,
) -> None:
    """Check every host: SSH, interpreter, versions, device, workdir, rendezvous port."""
    how = _options(HostsCheckSettings, options)
    inv = _inventory(inventory)
    reports = check_hosts(inv, accept_new_host_keys=how.accept_new_host_keys, timeout=how.timeout)
    table = Table(title=f"{inventory} ({inv.world_size} hosts, rendezvous "
                        f"{inv.master.advertise}:{inv.rendezvous.port})")
    table.add_column("host")
    table.add_column("rank", justify="right")
    for name in CHECKS:
        table.add_column(name)
    for report in reports:
        cells: list[Any] = [f"{report.host.name}\n{report.host.label}", str(report.host.rank)]
        for name in CHECKS:
            c = report.checks[name]
            if c.ok is None:
                cells.append(Text("-", style="dim"))
            else:
                style = "green" if c.ok else "bold red"
                cells.append(Text(("ok " if c.ok else "FAIL ") + c.detail, style=style))
        table.add_row(*cells)
    console.print(table)
    failed = [(r.host.name, name, c.fix) for r in reports for name, c in r.checks.items() if c.ok is False]
    for host, name, fix in failed:
        errors.print(Text.assemble((f"{host}: {name}: ", "bold red"), fix), soft_wrap=True)
    if failed:
        raise typer.Exit(1)
    console.print(f"all {inv.world_size} hosts ready")


@takes_options(HostsBenchSettings, BENCH)
def hosts_bench(
    inventory: Path = typer.Argument(..., help="Inventory file (hosts/NAME.yaml); at least 2 hosts."),
    **options: Any,
) -> None:
    """Measure latency and bandwidth between the hosts and write a cluster file.

    Every host runs as a rank of a launch (same SSH checks and rendezvous
    as `launch`) and all-reduces buffers of growing size with meshtrain's
    own ring over gloo. The alpha-beta model (all-reduce = 2(g-1) latency
    + bytes / bandwidth) is fitted to the median times by least squares;
    the table compares measured and model times. Then:

      meshtrain simulate --strategy diloco --cluster clusters/NAME.yaml
    """
    bench_hosts(inventory, _options(HostsBenchSettings, options))


def bench_hosts(inventory: Path, how: HostsBenchSettings) -> None:
    """Run ``hosts bench`` (:func:`~meshtrain.launch.benchmark.benchmark_hosts`) and print
    what it measured; ``meshtrain up`` runs its step 4 with it."""
    inv = _inventory(inventory)
    try:
        bench = benchmark_hosts(inventory, inv, how)
    except PreflightError as exc:
        for problem in exc.problems:
            errors.print(Text.assemble(("error: ", "bold red"), problem), soft_wrap=True)
        raise typer.Exit(2) from None
    except BenchmarkFailed as exc:
        _print_failures(exc.failures)
        raise fail_on(exc) from None
    except InputError as exc:
        raise fail_on(exc) from None
    cluster = bench.cluster
    table = Table(title=f"all-reduce over {inv.world_size} hosts: measured vs fitted model",
                  caption=str(inventory))
    for column in ("buffer", "sent per host", "measured", "model", "model error"):
        table.add_column(column, justify="right")
    for s in bench.samples:
        predicted = model_seconds(s, cluster)
        table.add_row(human_bytes(s.payload_bytes), human_bytes(s.moved_bytes), f"{s.seconds * 1e3:.3f} ms",
                      f"{predicted * 1e3:.3f} ms", f"{(predicted - s.seconds) / s.seconds:+.0%}")
    console.print(table)
    if bench.doubt:
        errors.print(f"warning: {bench.doubt}", style="bold yellow", highlight=False, markup=False,
                     soft_wrap=True)
    shared = " (shared by the hosts)" if how.shared_medium else " per link"
    console.print(f"fitted: latency {cluster.latency * 1e3:.3f} ms per message, bandwidth "
                  f"{human_bytes(cluster.bandwidth)}/s{shared}", highlight=False)
    if bench.probe_seconds:
        console.print(probe_note(bench) + f" ({cluster.probe})", highlight=False)
    console.print(f"wrote {bench.out}; use it with: meshtrain simulate --cluster {bench.out}",
                  highlight=False)


def _print_failures(failures: list[RankFailure]) -> None:
    for failure in failures:
        errors.print(Text.assemble(("failed: ", "bold red"), f"rank {failure.rank} on "
                                   f"{failure.host.name} ({failure.host.label}) {failure.reason}"),
                     soft_wrap=True)


def _options(cls: type[Options], given: dict[str, Any]) -> Options:
    """A hosts command's options, each checked by its own rule (exit 2 naming the flag)."""
    try:
        return from_flags(cls, given)
    except SettingError as exc:
        raise fail(str(exc)) from None


@takes_options(HostsDiscoverSettings, DISCOVER)
def hosts_discover(**options: Any) -> None:
    """Find machines on this network that advertise SSH (Bonjour) and write an inventory.

    Macs with Remote Login on announce ``_ssh._tcp`` over mDNS; so do Linux hosts running
    avahi. The list can be written as a starter inventory (--write).

    Nothing is connected to unless --check-keys is given, and then only the machines found.

      meshtrain hosts discover --check-keys --write hosts/mine.yaml
    """
    how = _options(HostsDiscoverSettings, options)
    timeout, force, check_keys, accepted_only = how.timeout, how.force, how.check_keys, how.accepted_only
    user, python, identity_file, known_hosts = how.user, how.python, how.identity_file, how.known_hosts
    write = Path(how.write) if how.write is not None else None
    try:
        d.require_zeroconf()
        net = d.parse_network(how.network) if how.network else None
    except d.DiscoveryError as exc:
        raise fail_on(exc) from None
    if not 0 < timeout <= 600:
        raise fail(f"--timeout: expected seconds between 0 and 600, got {timeout}")
    if accepted_only and not check_keys:
        raise fail("--accepted-only needs --check-keys (otherwise which machines accept your key "
                   "is not known)")
    if write is not None and write.exists() and not force:
        raise fail(f"--write {write}: the file exists; pass --force to replace it")
    if python is not None and not python.startswith(("/", "~")):
        raise fail(f"--python {python}: expected an absolute path on the hosts (or one starting with ~/)")
    if identity_file is not None:
        from meshtrain.hosts.ssh import identity_file_problem

        problem = identity_file_problem(str(Path(identity_file).expanduser()))
        if problem:
            raise fail(f"--{problem.replace('identity_file', 'identity-file', 1)}")
    try:
        found = d.browse(timeout, iface=how.iface, network=net)
    except d.DiscoveryError as exc:
        raise fail_on(exc) from None
    if not found:
        console.print(f"no machine advertised SSH within {timeout:g} s (on a Mac: System Settings > "
                      "General > Sharing > Remote Login)", highlight=False)
        if write is not None:
            raise fail(f"--write {write}: nothing found, nothing written", code=1)
        return
    where = write or Path("discovered")
    raw = d.inventory_dict(found, user=user, python=python, identity_file=identity_file,
                           known_hosts=known_hosts)
    try:
        inv = d.parse_inventory(raw, where)
    except InventoryError as exc:
        raise fail_on(exc) from None
    checks = d.check_keys(inv) if check_keys else None
    if checks is not None:  # machines that already let you in first: rank 0 should be one of them
        order = sorted(range(len(found)), key=lambda i: checks[raw["hosts"][i]["name"]].status != d.ACCEPTED)
        if accepted_only:
            order = [i for i in order if checks[raw["hosts"][i]["name"]].status == d.ACCEPTED]
        raw = {**raw, "hosts": [raw["hosts"][i] for i in order]}
        found = [found[i] for i in order]
    table = Table(title=f"machines advertising SSH ({len(found)} found in {timeout:g} s)")
    for column in ("name", "advertised as", "addresses", "port", "key"):
        table.add_column(column)
    for entry, f in zip(raw["hosts"], found, strict=True):
        key = Text("not checked", style="dim")
        if checks is not None:
            status = checks[entry["name"]].status
            key = Text(status, style="green" if status == d.ACCEPTED else "bold red")
        table.add_row(entry["name"], f"{f.service}\n{f.server}", "\n".join(f.addresses), str(f.port), key)
    console.print(table)
    for c in (checks or {}).values():
        if c.status != d.ACCEPTED:
            errors.print(Text(c.detail), soft_wrap=True)
    if write is None:
        return
    if not found:
        raise fail(f"--write {write}: no machine accepted the key, nothing written", code=1)
    try:
        text = d.inventory_text(raw, found, checks, write)
        d.write_inventory(write, text, force=force)
    except (InventoryError, d.DiscoveryError) as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"--write {write}: {exc.strerror or exc}", code=1) from None
    console.print(f"wrote {write} ({len(found)} hosts); next: meshtrain hosts check {write}", highlight=False)


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
            raise fail("--balance cannot be combined with --resume or --max-restarts yet: the shares "
                       "are measured at the start of a run and not kept in checkpoints")
        config.validate()
        strategy = build_strategy(spec)
        strategy.check_nodes(world_size)
        check_strategy_balance(strategy, config.balance)
        check_options(task, spec.task_options)
    except ValueError as exc:  # ConfigError, SettingError, FaultError, TaskError
        raise fail(str(exc)) from None
    return spec, task


def _plan_launch(inventory: Path, inv: Inventory, flags: dict[str, Any], overrides: list[str]
                 ) -> tuple[Plan, Path | None]:
    """``launch --strategy auto``: the planner's choice for the inventory's hosts, from the
    cluster file ``hosts bench`` wrote for them (``clusters/INVENTORY.yaml``, or ``--set
    cluster=...``) and its compute probe (or ``--set step_seconds=...``). Returns the plan
    and the cluster file the ranks should project onto (None for a named cluster)."""
    try:
        spec, task = resolve_run(flags, overrides, launched=False)
    except ValueError as exc:
        raise fail(str(exc)) from None
    given = any(item.partition("=")[0].strip() == "cluster" for item in overrides)
    default = Path("clusters") / f"{inventory.stem}.yaml"
    if not given and not default.is_file():
        raise fail(f"--strategy auto plans from the hosts' measured network: run `meshtrain hosts bench "
                   f"{inventory} --task {task.name}` (it writes {default}), or give --set cluster=FILE")
    name = spec.cluster if given else str(default)
    try:
        cluster = get_cluster(name)
    except ValueError as exc:
        raise fail(str(exc)) from None
    threads = inv.hosts[0].threads if len({h.threads for h in inv.hosts}) == 1 else None
    wanted = probe_label(task.name, spec.batch_size, threads)
    step = spec.step_seconds
    if step is None:
        if cluster.step_seconds is None or cluster.probe != wanted:
            timed = f"its probe timed {cluster.probe}" if cluster.probe else "it has no compute probe"
            threads_flag = f" --threads {threads}" if threads is not None else ""
            raise fail(f"--strategy auto: {name}: {timed}, this run is {wanted}: run `meshtrain hosts bench "
                       f"{inventory} --task {task.name} --batch-size {spec.batch_size}{threads_flag}`, or "
                       "give --set step_seconds=S (one step's compute on the slowest host)")
        step = cluster.step_seconds
    try:
        bundle = task.build(TaskOptions(spec.data, spec.seed, check_options(task, spec.task_options)))
    except ValueError as exc:
        raise fail(str(exc)) from None
    plan = recommend(Workload(trainable_parameters(bundle.model), step, inv.world_size), cluster)
    console.print(plan_table(plan))
    console.print(f"--strategy auto chose {plan.choice.label}", highlight=False)
    return plan, (Path(name) if name.endswith((".yaml", ".yml")) else None)


def _record_plan(run_dir: Path, plan: Plan) -> None:
    """config.yaml of a launch with ``--strategy auto``: the choice and its reasons under ``plan``."""
    config_file = run_dir / "config.yaml"
    try:
        config = yaml12.load(config_file.read_text())
    except (OSError, ValueError):
        return  # nothing usable came back: the copy-back already said why
    if isinstance(config, dict):
        config["plan"] = plan.as_config()
        atomic_write_text(config_file, yaml.safe_dump(config, sort_keys=False))


def _check_shrink(spec: RunSpec, max_restarts: int) -> None:
    """``--allow-shrink`` needs restarts, checkpoints, and a strategy whose checkpoint can
    continue on fewer nodes (see checkpoint.fewer_nodes_refusal); exit 2 otherwise."""
    if max_restarts < 1:
        raise fail("--allow-shrink continues after a restart: give --max-restarts 1 or more")
    if not spec.checkpoint_every:
        raise fail("--allow-shrink continues from a checkpoint: give --checkpoint-every")
    refusal = fewer_nodes_refusal(build_strategy(spec))
    if refusal:
        raise fail(f"--allow-shrink: {refusal}")


def _local_inputs(spec: RunSpec, task: Task) -> list[tuple[str, str, str]]:
    """(what, setting, path) for what a training run reads from this machine's disk: its
    data, and ``task_options.model`` when that names a local file or folder (not a hub id)."""
    if spec.data and not task.takes_data:  # here, before anything is shipped
        raise fail(f"task {task.name!r} reads no data file: drop --data {spec.data}")
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
    except ShipError as exc:
        raise fail_on(exc) from None
    for shipment in shipments:
        if not shipment.files:  # every rank would start, then find nothing to read
            raise fail(f"{shipment.what} {shipment.local}: the folder holds no files")
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
        raise fail(f"--out {out}: {existing} is a file, not a folder")
    try:
        with tempfile.TemporaryDirectory(dir=existing, prefix=".meshtrain-write-test-"):
            pass
    except OSError as exc:
        raise fail(f"--out {out}: cannot write into {existing} ({exc.strerror or exc})") from None


def _settings_file(spec: RunSpec, out: Path, run_id: str) -> Path:
    """Write the run's resolved settings to ``<out>/<run-id>.settings.yaml``: uploaded
    into every workdir, it is all a rank is told about what to train (no flags, no
    profile to look up there), and it stays here so that ``--resume`` can check a
    continuation before contacting any host. Removed once the run directory is back."""
    path = out / f"{run_id}.settings.yaml"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, settings_file_text(spec, f"resolved by meshtrain launch for run {run_id}"))
    return path


def _check_resume_here(spec: RunSpec, out: Path, run_id: str) -> None:
    """``--resume RUN-ID``: refuse, before any host is contacted, a finished run or
    settings the checkpointed run cannot continue with (simulate's rules: steps, logging
    and how it runs may change; what is trained and how may not). The hosts' checkpoints
    are checked again by every rank."""
    if (out / run_id / "summary.json").is_file():
        raise fail(f"--resume {run_id}: the run already finished ({out / run_id}); to train it "
                   "further, give --steps above its steps and a new --run-id")
    record = out / f"{run_id}.settings.yaml"
    if not record.is_file():  # launched from another machine or folder: the ranks check
        errors.print(f"note: {record} is missing, so the settings are checked on the hosts",
                     highlight=False, soft_wrap=True, markup=False)
        return
    try:
        saved = load_settings_file(str(record))
    except ConfigError as exc:
        raise fail(str(exc)) from None
    conflict = resume_conflict(saved, spec, 0)  # the step is known on the hosts
    if conflict:
        raise fail(f"--resume {run_id}: {conflict}")


def _apply_overrides(inv: Inventory, threads: int | None, heartbeat_timeout: float | None) -> Inventory:
    """``--threads`` and ``--heartbeat-timeout`` over the inventory's settings (bad value: exit 2)."""
    if threads is not None:
        try:
            check_flag(RunSpec, "threads", threads)  # the setting's own rule
        except SettingError as exc:
            raise fail(str(exc)) from None
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
        raise fail(f"--copy-back-limit {size!r}: expected a size such as 64GiB or 500MB") from None
    return CopyLimits(max_bytes=max_bytes, max_files=files)


def register(app: typer.Typer) -> None:
    """Add ``hosts check``, ``hosts bench`` and ``launch`` to the ``meshtrain`` app."""
    hosts_app = typer.Typer(help="Find, set up, check and measure the machines of an inventory.",
                            no_args_is_help=True)
    hosts_app.command("check")(hosts_check)
    hosts_app.command("bench")(hosts_bench)
    hosts_app.command("setup")(hosts_setup)
    hosts_app.command("discover")(hosts_discover)
    app.add_typer(hosts_app, name="hosts")

    @app.command("launch")
    @takes_settings("launch")
    def launch_command(
        inventory: Path = typer.Argument(..., help="Inventory file (hosts/NAME.yaml); rank 0 first."),
        command: list[str] = typer.Argument(
            None, help="After --: a command to run on every host instead (python means the host's "
                       "interpreter), e.g. -- python train.py --lr 3e-4"),
        dashboard: bool = dashboard_cli.DASHBOARD_FLAG,
        **settings: Any,
    ) -> None:
        """Train with one rank per host of INVENTORY, or run a command on every host (after --).

        Every rank gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, so a
        script calling Trainer.fit (or any torchrun script) joins the group. The output of
        every rank streams here; rank 0's run directory is copied back under --out.
        """
        set_: list[str] = list(settings.pop("set_"))
        try:
            how = LaunchSettings.checked({f.name: settings.pop(f.name)
                                          for f in dataclasses.fields(LaunchSettings)})
        except SettingError as exc:
            raise fail(str(exc)) from None
        upload = [Path(f) for f in how.upload]
        run_id, resume, device, threads = (settings.pop(k) for k in ("run_id", "resume", "device", "threads"))
        out = Path(settings.pop("out_dir") or RunSpec.out_dir)
        progress = settings.pop("progress") is not False
        strategy = settings["strategy"]
        for flag, value in (("--run-id", run_id), ("--resume", resume)):
            if value is not None:
                try:
                    check_run_id(value, flag)
                except SettingError as exc:
                    raise fail(str(exc)) from None
        inv = _inventory(inventory)
        limits = _copy_limits(how.copy_back_limit, how.copy_back_files)
        flags = dict(settings)  # the training settings, resolved here for every rank
        training = not command
        if command and (resume or how.max_restarts):
            raise fail("--resume and --max-restarts continue a training run: give training flags, "
                       "not a command after --")
        if resume and run_id and resume != run_id:
            raise fail(f"--resume {resume} continues that run id: drop --run-id {run_id}")
        if command and (any(v is not None for v in flags.values()) or set_ or device):
            raise fail("give training flags or a command after --, not both")
        for f in upload:
            if not f.is_file():
                raise fail(f"--upload {f}: no such file")
        if device:
            inv = dataclasses.replace(inv, hosts=tuple(dataclasses.replace(h, device=device)
                                                       for h in inv.hosts))
        inv = _apply_overrides(inv, threads, how.heartbeat_timeout)
        if how.allow_shrink and not training:
            raise fail("--allow-shrink continues a training run: give training flags, not a command after --")
        _check_out_dir(out)
        plan, cluster_file = None, None
        if training and flags["strategy"] == AUTO:  # chosen here, before any host is contacted
            plan, cluster_file = _plan_launch(inventory, inv, flags, set_)
            flags["strategy"] = plan.choice.strategy
            set_ = [*set_, *(f"{k}={v}" for k, v in plan.choice.options.items())]
        if training:
            spec, task = _resolve_training(flags, set_, inv.world_size,
                                           restarts=bool(resume or how.max_restarts))
            if how.allow_shrink:
                _check_shrink(spec, how.max_restarts)
            shipments, required = _ship_inputs(spec, task, how.no_ship)
            spec.progress = progress
            checkpoint_every = spec.checkpoint_every  # from a flag, the profile or --set
            if resume:
                _check_resume_here(spec, out, resume)
            run_id = resume or run_id or new_launch_id(strategy or "train", inv.world_size, out)
            if cluster_file is not None:  # the ranks project onto it: every workdir gets a copy
                upload = [*upload, cluster_file]
                spec.cluster = cluster_file.name
            settings_file = _settings_file(spec, out, run_id)
            upload = [*upload, settings_file]
            argv = training_argv(["--settings-file", settings_file.name])
            label = strategy or "train"
        else:
            argv, label = list(command), "script"
            shipments, required, settings_file, checkpoint_every = [], [], None, None
        # The program of a script command is looked up on every host in preflight, unless
        # it is the host's python or a file this launch uploads first.
        program = None if training or argv[0] in ("python", "python3") or \
            Path(argv[0]).name in {f.name for f in upload} else argv[0]
        options = LaunchOptions(run_id=resume or run_id or new_launch_id(label, inv.world_size, out),
                                out_dir=out, accept_new_host_keys=how.accept_new_host_keys,
                                uploads=list(upload), resume=bool(resume), max_restarts=how.max_restarts,
                                restart_wait=how.restart_wait, allow_shrink=how.allow_shrink,
                                shipments=shipments, required_paths=required, copy_limits=limits,
                                program=program)
        output = rank_output([h.name for h in inv.hosts], plain=how.plain, title=options.run_id,
                             log_dir=out / f"{options.run_id}.ranks")  # moved into the run directory
        try:
            names = [h.name for h in inv.hosts]
            with dashboard_cli.live_dashboard(dashboard, "launch", options.run_id, names,
                                              {"strategy": strategy or ""}) as board:
                with output:
                    result = launch(inv, argv, options, training=training, output=output)
                if board is not None and result.run_dir is not None:
                    board.load_directory(result.run_dir)  # the whole curve, projected time included
                if board is not None and result.exit_code != 0:
                    board.failed(f"the launch ended with exit code {result.exit_code}")
        except PreflightError as exc:
            for problem in exc.problems:
                errors.print(Text.assemble(("error: ", "bold red"), problem), soft_wrap=True)
            errors.print("nothing was started; `meshtrain hosts check` shows every host's state")
            if settings_file is not None and not resume:  # no run exists to continue
                settings_file.unlink(missing_ok=True)
            raise typer.Exit(2) from None
        # Kept while a run may be resumed: until its run directory is back (its config.yaml
        # then records the settings), and only if it wrote checkpoints.
        if settings_file is not None and (result.run_dir is not None or not spec.checkpoint_every):
            settings_file.unlink(missing_ok=True)
        if plan is not None and result.run_dir is not None:
            _record_plan(result.run_dir, plan)
        logs = output.keep_logs(result.run_dir)
        if logs:
            console.print(logs, highlight=False, soft_wrap=True)
        for failure in result.failures:
            errors.print(Text.assemble(
                ("failed: ", "bold red"),
                f"rank {failure.rank} on {failure.host.name} ({failure.host.label}) {failure.reason}"),
                soft_wrap=True)
            if failure.tail:
                errors.print(f"last lines of rank {failure.rank}:", style="bold")
                for line in failure.tail[-10:]:
                    errors.print(Text(f"  {line}"), soft_wrap=True)
        for event in result.restarts:
            shrunk = (f"; continued on {event['shrunk_to']} hosts without {event['dropped']} from step "
                      f"{event['at_step']}") if "shrunk_to" in event else ""
            console.print(f"restarted after rank {event['rank']} on {event['host']} {event['reason']}"
                          + shrunk, highlight=False)
        if result.exit_code == 1 and training and checkpoint_every:
            errors.print("the checkpoints stay on every host; continue with: "
                         + resume_command(sys.argv[1:], options.run_id), highlight=False, soft_wrap=True)
        if result.copy_failed:
            console.print(f"all {result.world_size} ranks finished in {result.seconds:.1f} s, but the run "
                          "directory was not copied back (see above)", highlight=False)
        if result.exit_code == 0:
            where = f"; run directory: {result.run_dir}" if result.run_dir else ""
            console.print(f"all {result.world_size} ranks finished in {result.seconds:.1f} s{where}",
                          highlight=False)
        raise typer.Exit(result.exit_code)


def main() -> None:  # pragma: no cover - lets `python -m meshtrain.cli.launch` work alone
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    register(app)
    app(args=sys.argv[1:])


if __name__ == "__main__":  # pragma: no cover
    main()
