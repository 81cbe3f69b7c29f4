"""The steps of ``meshtrain up`` that no single command takes: from machines found on the
LAN to a profile the planner chose.

``meshtrain up`` walks through discovery (:mod:`meshtrain.hosts.discovery`), key checks,
``hosts setup``, ``hosts bench``, ``plan`` and ``launch``; each of those is its own
command and keeps its own logic. What is new lives here:

* :func:`key_fixes`: for every machine that does not let us in yet, the one thing to do
  (the exact ``ssh-copy-id`` line for a key it lacks; never a password stored or typed here);
* :func:`plan_profile`: the planner's choice (:func:`meshtrain.build.choose_strategy`)
  for a profile on the measured cluster, with the strategy options that go with it;
* :func:`profile_text`: that choice as a self-contained profile a launch reads.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from meshtrain.config.layers import merge, parse_set
from meshtrain.config.profiles import load_profile
from meshtrain.config.spec import ConfigError, RunSpec
from meshtrain.hosts import discovery as d
from meshtrain.hosts.inventory import Host
from meshtrain.tasks import Task, TaskOptions, check_options

if TYPE_CHECKING:  # the build and the planner load torch: imported where a profile is built
    from meshtrain.planning import Plan

#: The key files ssh(1) tries when no identity file is given, in its order.
DEFAULT_KEYS = ("id_ed25519", "id_ecdsa", "id_rsa")

# What the user can do about a key check's outcome.
COPY_KEY = "copy-key"  # the host lacks our public key: ssh-copy-id
MAKE_KEY = "make-key"  # there is no key pair to copy: ssh-keygen first
ADD_TO_AGENT = "add-to-agent"  # the key has a passphrase: ssh-add
TRUST_HOST_KEY = "trust-host-key"  # first contact: the user compares a fingerprint
CANNOT_FIX_HERE = "cannot-fix-here"  # unreachable, changed or revoked host key


@dataclass(frozen=True)
class KeyFix:
    """What one host needs before a key login works."""

    host: Host
    kind: str  # COPY_KEY, MAKE_KEY, ADD_TO_AGENT, TRUST_HOST_KEY or CANNOT_FIX_HERE
    command: str | None  # the exact command to run here (None where there is none)
    detail: str  # the key check's one-line reason


def public_key(host: Host, home: Path | None = None) -> Path | None:
    """The public key a login to ``host`` offers: its identity file's ``.pub``, else the
    first of ``~/.ssh/id_ed25519.pub``, ``id_ecdsa.pub``, ``id_rsa.pub`` that exists."""
    if host.identity_file is not None:
        candidate = Path(host.identity_file + ".pub").expanduser()
        return candidate if candidate.is_file() else None
    folder = (home or Path.home()) / ".ssh"
    for name in DEFAULT_KEYS:
        if (folder / f"{name}.pub").is_file():
            return folder / f"{name}.pub"
    return None


def ssh_copy_id_line(host: Host, key: Path) -> str:
    """``ssh-copy-id -i KEY.pub [-p PORT] USER@ADDRESS``: the step that authorises ``key``
    on ``host`` (it asks for the host's password once, in ssh's own prompt)."""
    port = ["-p", str(host.port)] if host.port != 22 else []
    return shlex.join(["ssh-copy-id", "-i", str(key), *port, f"{host.user}@{host.hostname}"])


def key_fixes(hosts: list[Host], checks: dict[str, d.KeyCheck], home: Path | None = None) -> list[KeyFix]:
    """For each host whose key check did not pass, what to do about it (rank order)."""
    fixes: list[KeyFix] = []
    for host in hosts:
        check = checks[host.name]
        if check.status == d.ACCEPTED:
            continue
        if check.status == d.REFUSED:
            key = public_key(host, home)
            if key is None:
                where = host.identity_file or str((home or Path.home()) / ".ssh" / DEFAULT_KEYS[0])
                fixes.append(KeyFix(host, MAKE_KEY, shlex.join(["ssh-keygen", "-t", "ed25519", "-f",
                                                                where.removesuffix(".pub")]),
                                    check.detail))
            else:
                fixes.append(KeyFix(host, COPY_KEY, ssh_copy_id_line(host, key), check.detail))
        elif check.status == d.NEEDS_AGENT:
            agent_key = [host.identity_file] if host.identity_file else []  # bare: the ~/.ssh/id_* keys
            fixes.append(KeyFix(host, ADD_TO_AGENT, shlex.join(["ssh-add", *agent_key]), check.detail))
        elif check.status == d.HOST_KEY_UNKNOWN:
            fixes.append(KeyFix(host, TRUST_HOST_KEY, None, check.detail))
        else:
            fixes.append(KeyFix(host, CANNOT_FIX_HERE, None, check.detail))
    return fixes


@dataclass(frozen=True)
class ProfilePlan:
    """The planner's choice for a profile, and the settings a launch of it takes."""

    plan: Plan
    settings: dict[str, Any]  # the profile: every setting, strategy and options chosen


def profile_settings(profile: str, *, data: str | None, overrides: list[str]) -> dict[str, Any]:
    """``profile`` with ``data`` and the ``--set`` ``overrides`` applied, checked as
    ``simulate --strategy auto`` checks its settings (nothing is built). The strategy is
    the planner's to choose: ``--set`` may not name it or its options (as with auto).

    Raises ``ValueError`` (ConfigError, TaskError) naming the setting at fault.
    """
    from meshtrain.build import AUTO, resolve_run

    base = merge(load_profile(profile), {"data": data} if data is not None else {})
    layer = parse_set(overrides, base.get("strategy") or RunSpec.strategy)
    if "strategy" in layer or "strategy_options" in layer:
        raise ConfigError("--set: meshtrain up lets the planner choose the strategy and its options; to "
                          "run another, launch the profile it writes with --strategy and --set")
    # --set checked as a --set layer over the profile (its errors name the --set key).
    resolve_run({**_without_strategy(base), "strategy": AUTO}, overrides, launched=False)
    return merge(base, layer)


def _without_strategy(settings: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in settings.items() if k not in ("description", "strategy", "strategy_options")}


def _resolve_auto(given: dict[str, Any]) -> tuple[dict[str, Any], RunSpec, Task]:
    """(the settings but the strategy, and the spec and task) resolved as `simulate
    --strategy auto` resolves them: the planner fills in the strategy."""
    from meshtrain.build import AUTO, resolve_run

    flags = _without_strategy(given)
    spec, task = resolve_run({**flags, "strategy": AUTO}, [], launched=False)
    return flags, spec, task


def plan_profile(given: dict[str, Any], *, cluster: str, hosts: int) -> ProfilePlan:
    """Plan the settings ``given`` (from :func:`profile_settings`) for ``hosts`` hosts on
    ``cluster`` (a name or a ``hosts bench`` file): the model is built and timed here, as
    ``simulate --strategy auto`` does, and the chosen strategy keeps the options the profile
    gives it (a profile's DiLoCo ``outer_lr`` stays when DiLoCo is chosen) under the plan's.
    """
    from meshtrain.build import choose_strategy, task_suggestions

    flags, spec, task = _resolve_auto(given)
    spec.cluster, spec.nodes = cluster, hosts
    bundle = task.build(TaskOptions(spec.data, spec.seed, check_options(task, spec.task_options)))
    plan = choose_strategy(spec, task, bundle, runtime="launched")  # the hosts' ranks will train
    chosen = plan.choice.strategy
    own = given.get("strategy_options", {}) if given.get("strategy") == chosen else {}
    options = merge(merge(task_suggestions(task, chosen)["strategy_options"], own), plan.choice.options)
    settings = dict(flags)
    settings.update(strategy=chosen, strategy_options=options, nodes=hosts)
    # Local files by absolute path: the profile then launches from any folder.
    if settings.get("data") and Path(settings["data"]).expanduser().exists():
        settings["data"] = str(Path(settings["data"]).expanduser().resolve())
    model = (settings.get("task_options") or {}).get("model")
    if isinstance(model, str) and model and Path(model).expanduser().exists():
        local = str(Path(model).expanduser().resolve())
        settings["task_options"] = {**settings["task_options"], "model": local}
    return ProfilePlan(plan, settings)


def profile_text(chosen: ProfilePlan, *, inventory: Path, cluster: Path, source: str, path: Path) -> str:
    """The profile ``meshtrain up`` writes: the settings, with the plan's reasons as comments.

    Loading it back (:func:`meshtrain.config.spec.load_profile`) gives ``chosen.settings``.
    """
    plan = chosen.plan
    lines = [f"# Written by `meshtrain up` from profile {source} for {inventory} on {cluster}.",
             f"# Strategy chosen by the planner ({plan.workload.hosts} hosts, "
             f"{plan.workload.trainable_parameters:,} trainable parameters, "
             f"{plan.workload.step_seconds * 1e3:.1f} ms compute per step):"]
    lines += [f"#   {reason}" for reason in plan.reasons]
    lines += [f"# Launch it again with: meshtrain launch {inventory} --profile {path}", ""]
    description = f"{source} on {plan.workload.hosts} hosts, {plan.choice.label} (chosen by meshtrain up)"
    body = {"description": description, **chosen.settings}
    return "\n".join(lines) + yaml.safe_dump(body, sort_keys=False)
