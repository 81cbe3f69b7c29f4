"""``meshtrain hosts check`` and ``meshtrain launch``: the real-machines commands.

``register(app)`` adds them to the main ``meshtrain`` app. Bad input (inventory, flags,
a host that is not ready) prints one line and exits 2; a rank that fails exits 1; a
launcher stopped by Ctrl-C or SIGTERM exits 130 or 143 after stopping every rank.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from meshtrain.launch.checks import CHECKS, check_hosts
from meshtrain.launch.inventory import Inventory, InventoryError, load_inventory
from meshtrain.launch.launcher import LaunchOptions, PreflightError, launch, new_launch_id, training_argv

# Piped output (CI logs, tests) gets room for the whole table rather than 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
errors = Console(stderr=True)

# simulate's flag name for each training option the launcher forwards.
FORWARDED = {
    "profile": "--profile", "strategy": "--strategy", "task": "--task", "data": "--data",
    "steps": "--steps", "batch_size": "--batch-size", "microbatch_size": "--microbatch-size",
    "lr": "--lr", "seed": "--seed", "val_interval": "--val-interval",
}


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print one clear line (no traceback) and return the exit to raise."""
    errors.print(Text.assemble(("error: ", "bold red"), message), soft_wrap=True)
    return typer.Exit(code)


def _inventory(path: Path) -> Inventory:
    try:
        return load_inventory(path)
    except InventoryError as exc:
        raise fail(str(exc)) from None


def hosts_check(
    inventory: Path = typer.Argument(..., help="Inventory file (hosts/NAME.yaml)."),
    accept_new_host_keys: bool = typer.Option(
        False, "--accept-new-host-keys", help="Trust hosts seen for the first time (records their keys)."),
    timeout: float = typer.Option(10.0, "--timeout", help="Seconds to wait for each host."),
) -> None:
    """Check every host: SSH, interpreter, versions, device, workdir, rendezvous port."""
    inv = _inventory(inventory)
    reports = check_hosts(inv, accept_new_host_keys=accept_new_host_keys, timeout=timeout)
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


def _check_training_flags(flags: dict[str, Any], overrides: list[str]) -> None:
    """Catch bad training flags here (exit 2) rather than on every host."""
    from meshtrain.config import ConfigError, RunSpec, load_profile, parse_set, strategy_class
    from meshtrain.tasks import TaskError, get_task

    try:
        profile = load_profile(flags["profile"]) if flags.get("profile") else {}
        strategy = flags.get("strategy") or profile.get("strategy") or RunSpec.strategy
        strategy_class(strategy)
        get_task(flags.get("task") or profile.get("task") or RunSpec.task)
        parse_set(overrides, strategy)
    except (ConfigError, TaskError) as exc:
        raise fail(str(exc)) from None


def _apply_overrides(inv: Inventory, threads: int | None, heartbeat_timeout: float | None) -> Inventory:
    """``--threads`` and ``--heartbeat-timeout`` over the inventory's settings (bad value: exit 2)."""
    if threads is not None:
        if threads < 1:
            raise fail(f"--threads: expected a whole number of threads >= 1, got {threads}")
        inv = dataclasses.replace(inv, hosts=tuple(dataclasses.replace(h, threads=threads)
                                                   for h in inv.hosts))
    if heartbeat_timeout is not None:
        if not 0 < heartbeat_timeout < float("inf"):
            raise fail(f"--heartbeat-timeout: expected seconds > 0, got {heartbeat_timeout}")
        inv = dataclasses.replace(inv, rendezvous=dataclasses.replace(
            inv.rendezvous, heartbeat_timeout=heartbeat_timeout))
    return inv


def register(app: typer.Typer) -> None:
    """Add ``hosts check`` and ``launch`` to the ``meshtrain`` app."""
    from meshtrain.cli.main import TRAINING_FLAGS as F

    hosts_app = typer.Typer(help="Check the machines of an inventory before launching.",
                            no_args_is_help=True)
    hosts_app.command("check")(hosts_check)
    app.add_typer(hosts_app, name="hosts")

    @app.command("launch")
    def launch_command(
        inventory: Path = typer.Argument(..., help="Inventory file (hosts/NAME.yaml); rank 0 first."),
        command: list[str] = typer.Argument(
            None, help="After --: a command to run on every host instead (python means the host's "
                       "interpreter), e.g. -- python train.py --lr 3e-4"),
        out: Path = typer.Option(Path("runs"), "--out", help="Local folder for rank 0's run directory."),
        run_id: str = typer.Option(None, "--run-id", help="Name of the run directory."),
        accept_new_host_keys: bool = typer.Option(
            False, "--accept-new-host-keys", help="Trust hosts seen for the first time (records their "
                                                  "keys in known_hosts; changed keys are still refused)."),
        upload: list[Path] = typer.Option([], "--upload", help="Copy a local file into every workdir first."),
        progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress lines from rank 0."),
        threads: int = typer.Option(
            None, "--threads", help="Torch intra-op threads of every rank (overrides the inventory's "
                                    "'threads'; default: every core of each host)."),
        heartbeat_timeout: float = typer.Option(
            None, "--heartbeat-timeout", help="Stop the run when a rank sends no heartbeat for this many "
                                              "seconds (stopped or hung); default: the inventory's "
                                              "rendezvous.heartbeat_timeout, else 30."),
        profile: str = F["profile"],
        strategy: str = F["strategy"],
        task: str = F["task"],
        data: str = F["data"],
        steps: int = F["steps"],
        batch_size: int = F["batch_size"],
        microbatch_size: int = F["microbatch_size"],
        lr: float = F["lr"],
        device: str = F["device"],
        seed: int = F["seed"],
        val_interval: int = F["val_interval"],
        set_: list[str] = F["set_"],
    ) -> None:
        """Train with one rank per host of INVENTORY, or run a command on every host (after --).

        Every rank gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, so a
        script calling Trainer.fit (or any torchrun script) joins the group. The output of
        every rank streams here; rank 0's run directory is copied back under --out.
        """
        inv = _inventory(inventory)
        flags = dict(profile=profile, strategy=strategy, task=task, data=data, steps=steps,
                     batch_size=batch_size, microbatch_size=microbatch_size, lr=lr, seed=seed,
                     val_interval=val_interval)
        training = not command
        if command and (any(v is not None for v in flags.values()) or set_ or device):
            raise fail("give training flags or a command after --, not both")
        for f in upload:
            if not f.is_file():
                raise fail(f"--upload {f}: no such file")
        if device:
            inv = dataclasses.replace(inv, hosts=tuple(dataclasses.replace(h, device=device)
                                                       for h in inv.hosts))
        inv = _apply_overrides(inv, threads, heartbeat_timeout)
        if training:
            _check_training_flags(flags, set_)
            forwarded = [w for k, v in flags.items() if v is not None for w in (FORWARDED[k], str(v))]
            forwarded += [w for item in set_ for w in ("--set", item)]
            if not progress:
                forwarded.append("--no-progress")
            argv = training_argv(forwarded)
            label = strategy or "train"
        else:
            argv, label = list(command), "script"
        options = LaunchOptions(run_id=run_id or new_launch_id(label, inv.world_size, out), out_dir=out,
                                accept_new_host_keys=accept_new_host_keys, uploads=list(upload))
        try:
            result = launch(inv, argv, options, training=training)
        except PreflightError as exc:
            for problem in exc.problems:
                errors.print(Text.assemble(("error: ", "bold red"), problem), soft_wrap=True)
            errors.print("nothing was started; `meshtrain hosts check` shows every host's state")
            raise typer.Exit(2) from None
        for failure in result.failures:
            errors.print(Text.assemble(
                ("failed: ", "bold red"),
                f"rank {failure.rank} on {failure.host.name} ({failure.host.label}) {failure.reason}"),
                soft_wrap=True)
            if failure.tail:
                errors.print(f"last lines of rank {failure.rank}:", style="bold")
                for line in failure.tail[-10:]:
                    errors.print(Text(f"  {line}"), soft_wrap=True)
        if result.copy_failed:
            console.print(f"all {inv.world_size} ranks finished in {result.seconds:.1f} s, but the run "
                          "directory was not copied back (see above)", highlight=False)
        if result.exit_code == 0:
            where = f"; run directory: {result.run_dir}" if result.run_dir else ""
            console.print(f"all {inv.world_size} ranks finished in {result.seconds:.1f} s{where}",
                          highlight=False)
        raise typer.Exit(result.exit_code)


def main() -> None:  # pragma: no cover - lets `python -m meshtrain.cli.launch` work alone
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    register(app)
    app(args=sys.argv[1:])


if __name__ == "__main__":  # pragma: no cover
    main()
