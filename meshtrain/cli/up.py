"""``meshtrain up``: from machines on the LAN to a running fine-tune, one question at a time.

Six steps, each of them also a command of its own: find the machines (``hosts discover``),
get key logins working (the ``ssh-copy-id`` step shown, never a password asked for here),
install meshtrain on them (``hosts setup``), measure the network (``hosts bench``), choose
the strategy (``plan``) and write it into a profile, then train (``launch --dashboard``).
The functions the commands run (the library's, and the CLI's printing of them) run each
step, so ``up`` behaves exactly as they do; the new steps' logic lives in
:mod:`meshtrain.guided`. ``--yes`` asks nothing: hosts that do not
let us in are left out, unknown host keys are refused unless ``--accept-new-host-keys``.

Named ``up`` like ``docker compose up``: bring the whole thing up from what is described,
and running it again redoes only what changed (setup finds the hosts up to date).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import typer
from rich.prompt import Confirm, Prompt
from rich.table import Table
from rich.text import Text

from meshtrain.cli.console import errors, fail, fail_on, print_table
from meshtrain.cli.console import wide_console as console
from meshtrain.cli.dashboard import require_extra
from meshtrain.cli.flags import checked_options, takes_options
from meshtrain.cli.hosts_setup import setup_hosts
from meshtrain.cli.launch import bench_hosts, launch_hosts, print_discovery_problems
from meshtrain.cli.plan import plan_table
from meshtrain.config.hosts import UP, HostsBenchSettings, HostsSetupSettings, UpSettings
from meshtrain.guided import (
    COPY_KEY,
    MAKE_KEY,
    TRUST_HOST_KEY,
    KeyFix,
    key_fixes,
    plan_profile,
    profile_settings,
    profile_text,
)
from meshtrain.hosts import discovery as d
from meshtrain.hosts.inventory import Host, Inventory, InventoryError, parse_inventory
from meshtrain.interrupts import loading_quietly
from meshtrain.run_dir import atomic_write_text

STEPS = 6


@takes_options(UpSettings, UP)
def up(**options: Any) -> None:
    """Find the Macs on this network and fine-tune on them: keys, setup, benchmark, plan, launch.

    One question at a time; every step is also a command of its own (hosts discover,
    hosts setup, hosts bench, plan, launch), and the files it writes (an inventory, a
    cluster file, a profile) work with them.

      meshtrain up --data recordings/

      meshtrain up --yes --profile whisper-small-diloco --data recordings/
    """
    how = checked_options(UpSettings, options)
    with loading_quietly():  # torch and the engine, which checking the profile and planning load
        import meshtrain.build  # noqa: F401 - loaded here, where Ctrl-C is quiet, not mid-dialogue
        from meshtrain.planning import SOURCES
    name, profile, yes = how.name, how.profile, how.yes
    inventory, cluster, profile_out = (Path("hosts") / f"{name}.yaml", Path("clusters") / f"{name}.yaml",
                                       Path("profiles") / f"{name}.yaml")
    if not yes and not sys.stdin.isatty():  # every question would read end-of-file
        raise fail("meshtrain up asks its questions on a terminal: run it in one, or pass --yes")
    settings = _check_input(name, profile, how.data, how.set_, how.timeout, how.dashboard, how.identity_file)
    try:
        d.require_zeroconf()
        net = d.parse_network(how.network) if how.network else None
    except d.DiscoveryError as exc:
        raise fail_on(exc) from None
    existing = [str(p) for p in (inventory, cluster, profile_out) if p.exists()]
    if existing and not how.force:
        if yes or not _ask(f"{', '.join(existing)} exist{'s' if len(existing) == 1 else ''}: replace?",
                           default=False):
            raise fail(f"--name {name}: {', '.join(existing)} already exist; pass --force to replace them, "
                       "or choose another --name")

    _step(1, "find the machines")
    try:
        discovery = d.browse(how.timeout, iface=how.iface, network=net, known=d.known_addresses(inventory))
    except d.DiscoveryError as exc:
        raise fail_on(exc) from None
    found = discovery.found  # conflicting names are left out: never offered, even to --yes
    print_discovery_problems(discovery)
    raw = d.inventory_dict(found, user=how.user, identity_file=how.identity_file, known_hosts=how.known_hosts)
    raw["defaults"]["workdir"] = how.workdir
    whole = _parse(raw, inventory) if found else None
    hosts = whole.hosts if whole is not None else ()
    _show_found(found, hosts, how.timeout)
    chosen = _choose(list(hosts), yes)
    if len(chosen) < 2:
        raise fail(f"training across machines needs at least 2, {len(chosen)} chosen", code=1)

    _step(2, "key logins")
    assert whole is not None  # two machines or more were chosen
    chosen, checks = _key_logins(whole, chosen, yes, how.accept_new_host_keys)
    if len(chosen) < 2:
        raise fail(f"{len(chosen)} machine{'' if len(chosen) == 1 else 's'} let us in; training needs "
                   "at least 2: do the steps above, then run meshtrain up again", code=1)
    kept = [i for i, h in enumerate(hosts) if h in chosen]
    raw = {**raw, "hosts": [raw["hosts"][i] for i in kept]}
    try:
        text = d.inventory_text(raw, [found[i] for i in kept], checks, inventory)
        d.write_inventory(inventory, text, force=True)
    except (InventoryError, d.DiscoveryError) as exc:
        raise fail(str(exc)) from None
    console.print(f"wrote {inventory} ({len(chosen)} hosts: {', '.join(h.name for h in chosen)})",
                  highlight=False)

    _step(3, "install meshtrain on them (hosts setup)")
    if yes or _ask(f"Install this meshtrain and its pinned packages on the {len(chosen)} machines, in "
                   f"{how.workdir}/.venv (their pip needs a package index)?"):
        setup_hosts(inventory, HostsSetupSettings(base_python=how.base_python, pip_arg=how.pip_arg,
                                                  wheel=how.wheel))
    else:
        console.print("skipped: the inventory's python must already have meshtrain "
                      f"(check with: meshtrain hosts check {inventory})", highlight=False)

    _step(4, "measure the network (hosts bench)")
    bench_hosts(inventory, HostsBenchSettings(out=str(cluster), name=name))

    _step(5, "choose the strategy (plan)")
    try:
        with console.status(f"timing {profile}'s model here"):
            chosen_plan = plan_profile(settings, cluster=str(cluster), hosts=len(chosen))
    except ValueError as exc:  # ConfigError, TaskError, a bad setting
        raise fail(str(exc)) from None
    console.print(plan_table(chosen_plan.plan))
    console.print(SOURCES, style="dim", highlight=False)
    atomic_write_text(profile_out, profile_text(chosen_plan, inventory=inventory, cluster=cluster,
                                                source=profile, path=profile_out))
    console.print(f"wrote {profile_out}", highlight=False)

    _step(6, "train (launch)")
    command = f"meshtrain launch {inventory} --profile {profile_out}"
    if how.dashboard:
        command += " --dashboard"
    if not (yes or _ask(f"Start training {chosen_plan.plan.choice.label} on {len(chosen)} machines now?")):
        console.print(f"not started; start it any time with: {command}", highlight=False)
        return
    console.print(f"$ {command}", highlight=False)
    launch_hosts(inventory, None, how.dashboard, {"profile": str(profile_out)})


def _check_input(name: str, profile: str, data: str | None, overrides: list[str], timeout: float,
                 dashboard: bool, identity_file: str | None) -> dict[str, Any]:
    """Bad input is one line and exit 2, before anything is looked for; returns the
    profile's settings with --data and --set applied."""
    if not name or Path(name).name != name or name.startswith("."):
        raise fail(f"--name {name!r}: expected a plain file name such as lan")
    if not 0 < timeout <= 600:
        raise fail(f"--timeout: expected seconds between 0 and 600, got {timeout}")
    if data is not None and not Path(data).expanduser().exists():
        raise fail(f"--data {data}: no such file or folder")
    try:
        settings = profile_settings(profile, data=data, overrides=overrides)
    except ValueError as exc:  # ConfigError, TaskError: names the profile, key or --set at fault
        raise fail(str(exc)) from None
    if dashboard:
        require_extra("--dashboard (or pass --no-dashboard)")
    if identity_file is not None:
        from meshtrain.hosts.ssh import identity_file_problem

        problem = identity_file_problem(str(Path(identity_file).expanduser()))
        if problem:
            raise fail(f"--{problem.replace('identity_file', 'identity-file', 1)}")
    return settings


def _step(number: int, title: str) -> None:
    console.rule(f"[bold]{number}/{STEPS}[/] {title}", align="left")


def _ask(question: str, default: bool = True) -> bool:
    return Confirm.ask(question, console=console, default=default)


def _parse(raw: dict[str, Any], where: Path) -> Inventory:
    try:
        return parse_inventory(raw, where)
    except InventoryError as exc:
        raise fail_on(exc) from None


def _show_found(found: list[d.Found], hosts: tuple[Host, ...], timeout: float) -> None:
    if not found:
        console.print(f"no machine advertised SSH within {timeout:g} s. On each Mac: System Settings > "
                      "General > Sharing > Remote Login (on).", highlight=False)
        return
    table = Table(title=f"{len(found)} machine{'' if len(found) == 1 else 's'} found")
    for column in ("name", "advertised as", "address"):
        table.add_column(column)
    for f, h in zip(found, hosts, strict=True):
        table.add_row(h.name, Text(f.service), f"{h.hostname}:{h.port}")  # a stranger's name: not markup
    print_table(table, console)


def _choose(hosts: list[Host], yes: bool) -> list[Host]:
    """Every machine with --yes or a yes to "all of them?"; otherwise one question each."""
    if yes or len(hosts) < 2 or _ask(f"Train on all {len(hosts)} machines?"):
        return hosts
    return [h for h in hosts if _ask(f"Use {h.name} ({h.hostname})?")]


def _key_logins(whole: Inventory, hosts: list[Host], yes: bool,
                accept_new: bool) -> tuple[list[Host], dict[str, d.KeyCheck]]:
    """Check key logins until every host lets us in or is left out; (kept hosts, checks)."""
    trusted_once: set[str] = set()  # a host still unknown after that cannot be fixed by trusting
    while True:
        with console.status(f"trying a key login on {len(hosts)} machines"):
            checks = d.check_keys(dataclasses.replace(whole, hosts=tuple(hosts)))
        fixes = key_fixes(hosts, checks)
        for h in hosts:
            if checks[h.name].status == d.ACCEPTED:
                console.print(Text.assemble((f"{h.name}: ", "bold"), ("key login works", "green")))
        if not fixes:
            return hosts, checks
        trusted = [f for f in fixes if f.kind == TRUST_HOST_KEY and f.host.name not in trusted_once
                   and _trust(f, yes, accept_new)]
        trusted_once.update(f.host.name for f in trusted)
        pending = [f for f in fixes if f not in trusted]
        for fix in pending:
            _show_fix(fix)
        if not pending:
            continue  # the keys just trusted: check those logins again
        fixable = [f for f in pending if f.kind in (COPY_KEY, MAKE_KEY) or f.command]
        if yes or not fixable:
            left_out = {f.host.name for f in pending}
            errors.print(f"left out: {', '.join(sorted(left_out))}", highlight=False)
            return [h for h in hosts if h.name not in left_out], checks
        answer = Prompt.ask("Run those in another terminal, then press Enter to check again "
                            "(or type skip to leave those machines out)", console=console, default="",
                            show_default=False)
        if answer.strip().lower() == "skip":
            left_out = {f.host.name for f in pending}
            return [h for h in hosts if h.name not in left_out], checks


def _trust(fix: KeyFix, yes: bool, accept_new: bool) -> bool:
    """Record an unknown host key when the user says so (asked, showing the fingerprint)."""
    from meshtrain.hosts.ssh import SSHError, connect

    console.print(Text.assemble((f"{fix.host.name}: ", "bold"), fix.detail.split(": ", 1)[-1].split(";")[0]))
    if not (accept_new if yes else _ask(f"Trust {fix.host.name}'s host key? Compare the fingerprint with "
                                        "the machine's own (ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub "
                                        "there)", default=False)):
        return False
    try:
        connect(fix.host, accept_new_host_keys=True).close()
    except SSHError:
        pass  # the key is recorded before logging in; the next check says what else is wrong
    return True


def _show_fix(fix: KeyFix) -> None:
    line = Text.assemble((f"{fix.host.name}: ", "bold red"), fix.detail.split(": ", 1)[-1])
    console.print(line, soft_wrap=True)
    if fix.command:
        console.print(Text.assemble("  run: ", (fix.command, "bold")), soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("up")(up)
