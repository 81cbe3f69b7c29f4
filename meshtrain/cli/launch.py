"""``meshtrain hosts check`` and ``meshtrain launch``: the real-machines commands.

``register(app)`` adds them to the main ``meshtrain`` app. Bad input (inventory, flags,
a host that is not ready) prints one line and exits 2; a rank that fails exits 1; a
launcher stopped by Ctrl-C or SIGTERM exits 130 or 143 after stopping every rank.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand

from meshtrain.cli import dashboard as dashboard_cli
from meshtrain.cli.console import errors, fail, fail_on, print_table, terminal_text
from meshtrain.cli.console import wide_console as console  # the hosts commands' output
from meshtrain.cli.flags import checked_options, takes_options, takes_settings
from meshtrain.cli.hosts_setup import hosts_setup
from meshtrain.cli.plan import plan_table
from meshtrain.config.hosts import (
    BENCH,
    CHECK,
    DISCOVER,
    HostsBenchSettings,
    HostsCheckSettings,
    HostsDiscoverSettings,
)
from meshtrain.errors import InputError
from meshtrain.hosts import discovery as d
from meshtrain.hosts.inventory import Inventory, InventoryError, load_inventory, parse_inventory
from meshtrain.interrupts import loading_quietly
from meshtrain.launch.adding import RunControl, entry_from_words
from meshtrain.launch.live import rank_output
from meshtrain.progress import human_bytes

# These load torch: each command imports them where it runs (in loading_quietly), so the
# commands build, and --help answers, without torch.
if TYPE_CHECKING:
    from meshtrain.launch.launcher import LaunchResult, RankFailure
    from meshtrain.planning import Plan


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
    inventory: Path = typer.Argument(..., metavar="INVENTORY", help="Inventory file (hosts/NAME.yaml)."),
    **options: Any,
) -> None:
    """Check every host: SSH, interpreter, versions, device, workdir, rendezvous port."""
    how = checked_options(HostsCheckSettings, options)
    inv = _inventory(inventory)
    with loading_quietly():
        from meshtrain.hosts.checks import CHECKS, check_hosts
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
    print_table(table, console)
    failed = [(r.host.name, name, c.fix) for r in reports for name, c in r.checks.items() if c.ok is False]
    for host, name, fix in failed:
        errors.print(Text.assemble((f"{host}: {name}: ", "bold red"), fix), soft_wrap=True)
    if failed:
        raise typer.Exit(1)
    console.print(f"all {inv.world_size} hosts ready")


@takes_options(HostsBenchSettings, BENCH)
def hosts_bench(
    inventory: Path = typer.Argument(..., metavar="INVENTORY",
                                     help="Inventory file (hosts/NAME.yaml); at least 2 hosts."),
    **options: Any,
) -> None:
    """Measure latency and bandwidth between the hosts and write a cluster file.

    Every host runs as a rank of a launch (same SSH checks and rendezvous
    as `launch`) and all-reduces buffers of growing size with meshtrain's
    own ring over gloo. The alpha-beta model (all-reduce = 2(g-1) latency
    + bytes / bandwidth) is fitted to the median times: the bandwidth from
    the large sizes (the sustained rate), the latency from the small ones;
    the table compares measured and model times. Then:

      meshtrain simulate --strategy diloco --cluster clusters/NAME.yaml
    """
    bench_hosts(inventory, checked_options(HostsBenchSettings, options))


def bench_hosts(inventory: Path, how: HostsBenchSettings) -> None:
    """Run ``hosts bench`` (:func:`~meshtrain.launch.benchmark.benchmark_hosts`) and print
    what it measured; ``meshtrain up`` runs its step 4 with it."""
    inv = _inventory(inventory)
    with loading_quietly():
        from meshtrain.hosts.bench import model_seconds
        from meshtrain.launch.benchmark import BenchmarkFailed, benchmark_hosts, probe_note
        from meshtrain.launch.launcher import PreflightError
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
    for choice in bench.links:
        tried = ", ".join(f"{m.address.ip} ({m.address.iface}) from {m.sender}: "
                          + (f"{human_bytes(m.bandwidth)}/s" if m.bandwidth is not None
                             else f"not measured ({m.problem})")
                          for m in choice.measurements)
        console.print(f"fastest link to {choice.host}: {choice.address.ip} on {choice.address.iface}, "
                      f"{human_bytes(choice.bandwidth)}/s (measured {tried})", highlight=False,
                      markup=False, soft_wrap=True)
    if bench.inventory_updated:
        console.print(f"recorded the fastest links in {inventory} (advertise, iface, link_bandwidth)",
                      highlight=False)
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


@takes_options(HostsDiscoverSettings, DISCOVER)
def hosts_discover(**options: Any) -> None:
    """Find machines on this network that advertise SSH (Bonjour) and write an inventory.

    Macs with Remote Login on announce ``_ssh._tcp`` over mDNS; so do Linux hosts running
    avahi. The list can be written as a starter inventory (--write).

    Nothing is connected to unless --check-keys is given, and then only the machines found.

      meshtrain hosts discover --check-keys --write hosts/mine.yaml
    """
    how = checked_options(HostsDiscoverSettings, options)
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
        discovery = d.browse(timeout, iface=how.iface, network=net, known=d.known_addresses(write))
    except d.DiscoveryError as exc:
        raise fail_on(exc) from None
    found = discovery.found
    print_discovery_problems(discovery)
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
        inv = parse_inventory(raw, where)
    except InventoryError as exc:
        raise fail_on(exc) from None
    checks = d.check_keys(inv) if check_keys else None
    if checks is not None:  # machines that already let you in first: rank 0 should be one of them
        order = sorted(range(len(found)), key=lambda i: checks[raw["hosts"][i]["name"]].status != d.ACCEPTED)
        if accepted_only:
            order = [i for i in order if checks[raw["hosts"][i]["name"]].status == d.ACCEPTED]
        raw = {**raw, "hosts": [raw["hosts"][i] for i in order]}
        found = [found[i] for i in order]
    table = Table(title=f"machines advertising SSH ({len(found)} found in {discovery.seconds:.0f} s)")
    for column in ("name", "advertised as", "addresses", "port", "key"):
        table.add_column(column)
    for entry, f in zip(raw["hosts"], found, strict=True):
        key = Text("not checked", style="dim")
        if checks is not None:
            status = checks[entry["name"]].status
            key = Text(status, style="green" if status == d.ACCEPTED else "bold red")
        # Text, not markup: an advertised name is a stranger's ("[link=...]" stays text).
        advertised = Text(f"{f.service}\n{f.server}")
        table.add_row(entry["name"], advertised, "\n".join(f.addresses), str(f.port), key)
    print_table(table, console)
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


def print_discovery_problems(discovery: d.Discovery) -> None:
    """One warning line per thing discovery left out (conflicts, floods, unusable addresses)."""
    for problem in discovery.problems:  # names in them are a stranger's: text, never markup
        errors.print(Text.assemble(("warning: ", "bold yellow"), problem), soft_wrap=True)


def launch_hosts(inventory: Path, command: list[str] | None, dashboard: bool,
                 settings: dict[str, Any]) -> None:
    """Run ``meshtrain launch`` (:func:`~meshtrain.launch.training.prepare_launch`, the
    launcher, :func:`~meshtrain.launch.training.finish_launch`) and print how it went; exits
    with the launch's status. ``settings``: the command's options by setting name (a
    caller gives only what it sets). ``meshtrain up`` runs its step 6 with it."""
    with loading_quietly():
        from meshtrain.launch.launcher import FINISHED_WITHOUT, PreflightError, launch
        from meshtrain.launch.training import abandon_launch, finish_launch, prepare_launch
    try:
        prepared = prepare_launch(inventory, command, settings, show_plan=_show_plan, note=_note)
    except InputError as exc:
        raise fail_on(exc) from None
    inv, options, training, how = prepared.inventory, prepared.options, prepared.training, prepared.how
    strategy = prepared.strategy
    output = rank_output([h.name for h in inv.hosts], plain=how.plain, title=options.run_id,
                         log_dir=options.out_dir / f"{options.run_id}.ranks")  # moved into the run directory
    try:
        names = [h.name for h in inv.hosts]
        with dashboard_cli.live_dashboard(dashboard, "launch", options.run_id, names,
                                          {"strategy": strategy or ""}) as board:
            with output:
                result = launch(inv, prepared.argv, options, training=training, output=output)
            if board is not None and result.run_dir is not None:
                board.load_directory(result.run_dir)  # the whole curve, projected time included
            if board is not None and result.exit_code != 0:
                board.failed(f"the launch ended with exit code {result.exit_code}")
    except PreflightError as exc:
        for problem in exc.problems:
            errors.print(Text.assemble(("error: ", "bold red"), problem), soft_wrap=True)
        errors.print("nothing was started; `meshtrain hosts check` shows every host's state")
        abandon_launch(prepared)  # no run exists to continue
        raise typer.Exit(2) from None
    finish_launch(prepared, result, note=_note)
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
    # A failed copy-back follows a finished run: --resume would refuse it ("already finished").
    if result.exit_code == 1 and training and prepared.checkpoint_every and not result.copy_failed:
        errors.print("the checkpoints stay on every host; continue with: "
                     + resume_command(sys.argv[1:], options.run_id), highlight=False, soft_wrap=True)
    if result.copy_failed:
        console.print(f"all {result.world_size} ranks finished in {result.seconds:.1f} s, but the run "
                      "directory was not copied back (see above)", highlight=False)
    if result.exit_code == 0:
        where = f"; run directory: {result.run_dir}" if result.run_dir else ""
        rejoined = elastic_line(result)
        console.print(f"all {result.world_size} ranks finished in {result.seconds:.1f} s{rejoined}{where}",
                      highlight=False)
    if result.exit_code == FINISHED_WITHOUT:
        where = f"; run directory: {result.run_dir}" if result.run_dir else ""
        console.print(f"finished in {result.seconds:.1f} s without {', '.join(result.left_out)} (lost, and "
                      f"not back in the run before its end){elastic_line(result)}{where}", highlight=False)
    raise typer.Exit(result.exit_code)


def elastic_line(result: LaunchResult) -> str:
    """``--elastic``: hosts added, and which ranks were lost and how often they came back, for
    the last line."""
    parts = [f"{h.name} added as rank {h.rank}" for h in result.added]
    parts += [f"rank {h.rank} on {h.host} lost {len(h.lost)}x, rejoined {h.rejoined}x"
              for h in result.history]
    return f" ({'; '.join(parts)})" if parts else ""


def _show_plan(plan: Plan) -> None:
    console.print(plan_table(plan))
    console.print(f"--strategy auto chose {plan.choice.label}", highlight=False)


def _note(line: str) -> None:
    errors.print(terminal_text(line), highlight=False, soft_wrap=True, markup=False)


BARE_DASHES = "meshtrain.launch.bare_dashes"


class _LaunchCommand(TyperCommand):
    """``launch``: notes whether its command line ends with ``--``, which click drops
    (``launch inv.yaml --`` then looked like no command at all, and trained)."""

    # ctx: typer's own click Context (typer bundles click privately; its name is not public).
    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        ctx.meta[BARE_DASHES] = bool(args) and args[-1] == "--"
        return super().parse_args(ctx, args)


def hosts_add(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR",
                                   help="<out>/<run-id> of a running `meshtrain launch --elastic`."),
    entry: list[str] = typer.Argument(..., metavar="KEY=VALUE...",
                                      help="The new host in the inventory's keys, e.g. name=studio-3 "
                                           "host=192.168.1.103 threads=8 (the inventory's defaults apply)."),
) -> None:
    """Add a host to a running `launch --elastic`: checked over SSH as at launch, it joins at a sync."""
    try:
        host = RunControl.of_running(run_dir).request(entry_from_words(entry))
    except InputError as exc:
        raise fail_on(exc) from None
    console.print(f"asked the launch to add {host.name} ({host.label}) as rank {host.rank}; the launch's "
                  "output says when it has joined", highlight=False)


def register(app: typer.Typer) -> None:
    """Add ``hosts check``, ``hosts bench`` and ``launch`` to the ``meshtrain`` app."""
    hosts_app = typer.Typer(help="Find, set up, check and measure the machines of an inventory.",
                            no_args_is_help=True)
    hosts_app.command("check")(hosts_check)
    hosts_app.command("bench")(hosts_bench)
    hosts_app.command("setup")(hosts_setup)
    hosts_app.command("discover")(hosts_discover)
    hosts_app.command("add")(hosts_add)
    app.add_typer(hosts_app, name="hosts")

    @app.command("launch", cls=_LaunchCommand)
    @takes_settings("launch")
    def launch_command(
        ctx: typer.Context,
        inventory: Path = typer.Argument(..., metavar="INVENTORY",
                                         help="Inventory file (hosts/NAME.yaml); rank 0 first."),
        command: list[str] = typer.Argument(
            None, metavar="COMMAND",
            help="After --: a command to run on every host instead (python means the host's "
                 "interpreter), e.g. -- python train.py --lr 3e-4"),
        dashboard: bool = dashboard_cli.DASHBOARD_FLAG,
        **settings: Any,
    ) -> None:
        """Train with one rank per host of INVENTORY, or run a command on every host (after --).

        Every rank gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, so a
        script calling Trainer.fit (or any torchrun script) joins the group. The output of
        every rank streams here; rank 0's run directory is copied back under --out.
        """
        # A bare `--` at the end meant a command and gave none: [] (refused), not None (train).
        launch_hosts(inventory, [] if ctx.meta.get(BARE_DASHES) and not command else command,
                     dashboard, settings)


def main() -> None:  # pragma: no cover - lets `python -m meshtrain.cli.launch` work alone
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    register(app)
    app(args=sys.argv[1:])


if __name__ == "__main__":  # pragma: no cover
    main()
