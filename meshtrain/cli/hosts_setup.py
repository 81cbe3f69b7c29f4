"""``meshtrain hosts setup INVENTORY``: install this machine's meshtrain on every host.

A progress row per host (spinner and stage) while the hosts are set up in parallel,
then one line per host, then the inventory's ``python:`` pointed at the new
environments (or what to set, where the file cannot be edited safely). Exit 0 when
every host is ready, 1 when any failed (each failure is one line naming the host), 2
for bad input.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text

from meshtrain.cli.console import errors, fail
from meshtrain.cli.console import wide_console as console  # the hosts commands' output
from meshtrain.cli.flags import checked_options, takes_options
from meshtrain.config.hosts import HOSTS_SETUP, HostsSetupSettings
from meshtrain.hosts.inventory import Host, InventoryError, load_inventory
from meshtrain.hosts.inventory_edit import set_python
from meshtrain.hosts.local_install import LocalInstallError, local_install, make_workdir
from meshtrain.hosts.provisioning import FAILED, INSTALLED, UP_TO_DATE, SetupOptions, provision_hosts

T = TypeVar("T")


@takes_options(HostsSetupSettings, HOSTS_SETUP)
def hosts_setup(inventory: Path = typer.Argument(..., metavar="INVENTORY",
                                                 help="Inventory file (hosts/NAME.yaml)."),
                **options: Any) -> None:
    """Install this machine's meshtrain, torch, transformers and peft on every host.

    Per host: a virtual environment in WORKDIR/.venv (reused when present), the
    exact dependency versions installed here (from the host's package index), and
    this meshtrain as a wheel sent over SSH. A second run checks and changes nothing.
    """
    setup_hosts(inventory, checked_options(HostsSetupSettings, options))


def setup_hosts(inventory: Path, how: HostsSetupSettings) -> None:
    """Run ``hosts setup`` (:func:`~meshtrain.hosts.provisioning.provision_hosts` under a
    progress row per host) and print how it went; ``meshtrain up`` runs its step 3 with it."""
    try:
        inv = load_inventory(inventory)
    except InventoryError as exc:
        raise fail(str(exc)) from None
    started = time.monotonic()
    workdir = make_workdir()
    try:
        try:
            local = local_install(workdir, Path(how.wheel) if how.wheel is not None else None)
        except LocalInstallError as exc:
            raise fail(str(exc), code=2 if how.wheel is not None else 1) from None
        options = SetupOptions(base_python=how.base_python, pip_args=tuple(how.pip_arg),
                               accept_new_host_keys=how.accept_new_host_keys, timeout=how.timeout)
        console.print(f"meshtrain {local.version} ({local.source}) with "
                      f"{', '.join(local.pins)}", highlight=False, soft_wrap=True)
        results = _with_progress(inv.hosts, lambda stage: provision_hosts(inv, local, options, stage))
    except KeyboardInterrupt:
        errors.print(f"interrupted: setup stopped on every host, {inventory} not changed; run `meshtrain "
                     "hosts setup` again to finish", style="bold yellow", highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    for r in results:
        if r.status == FAILED:
            line = f"{r.host.name} ({r.host.label}): {r.detail}"
            errors.print(Text.assemble(("failed: ", "bold red"), line), soft_wrap=True)
        else:
            took = f" in {r.seconds:.1f} s" if r.shared_with is None else ""
            console.print(f"{r.host.name}: {r.status}{took}: {r.detail}", highlight=False, soft_wrap=True)
    if any(r.status == FAILED for r in results):
        errors.print(f"{inventory} not changed: fix the failed hosts and run `meshtrain hosts setup` again",
                     highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    wanted = {r.host.name: r.python for r in results if r.python is not None}
    edit = set_python(inventory, wanted, write=how.write_inventory)
    if edit.written:
        console.print(f"{inventory}: python of {', '.join(edit.changed)} set to the new environment",
                      highlight=False)
    elif edit.by_hand:
        console.print(f"set in {inventory}: " + "; ".join(edit.by_hand), highlight=False, soft_wrap=True)
    changed = edit.written or any(r.status != UP_TO_DATE for r in results)
    summary = "every host ready" if changed else "everything up to date, nothing changed"
    console.print(f"{summary} ({inv.world_size} hosts, {time.monotonic() - started:.1f} s); "
                  f"check with: meshtrain hosts check {inventory}", highlight=False)


def _with_progress(hosts: tuple[Host, ...], work: Callable[[Callable[[Host, str], None]], T]) -> T:
    """Run ``work(on_stage)`` under a rich progress row per host."""
    progress = Progress(SpinnerColumn(), TextColumn("[bold]{task.fields[host]}"),
                        TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                        transient=not console.is_terminal)
    rows: dict[str, TaskID] = {}
    with progress:
        for h in hosts:
            rows[h.name] = progress.add_task("waiting", total=None, host=h.name)

        def on_stage(host: Host, stage: str) -> None:
            progress.update(rows[host.name], description=stage)
            if stage in (INSTALLED, UP_TO_DATE, FAILED):
                progress.update(rows[host.name], total=1, completed=1)

        return work(on_stage)
