"""The options of ``meshtrain hosts check``, ``hosts bench``, ``hosts discover``,
``hosts setup`` and ``meshtrain up``, defined once like the training settings (an option two commands share is
one field, whose flag names both).

Each field carries its help, limits and :class:`~meshtrain.config.settings.Flag`: the
commands' options are generated from them (:func:`meshtrain.cli.flags.takes_options`) and
:func:`~meshtrain.config.settings.from_flags` applies the limits. A rule that spans
options (the compute probe's flags need ``--task``) is checked by the command.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.config.settings import OPTIONS, Flag, setting

CHECK, BENCH, DISCOVER, HOSTS_SETUP, UP = "hosts check", "hosts bench", "hosts discover", "hosts setup", "up"
#: Help panels of ``hosts bench``.
MEASURE, PROBE, CLUSTER_FILE = "What to measure", "Compute probe", "The cluster file"
#: Help panels of ``hosts discover`` and ``up``.
FINDING, TRAINING, SETUP = "Finding the machines", "What to fine-tune", "Setting them up (hosts setup)"


def _flag(names: tuple[str, ...], *commands: str, panel: str = OPTIONS, metavar: str | None = None,
          up_help: str | None = None, up_panel: str | None = None) -> Flag:
    """A flag of ``commands``; ``up_help`` and ``up_panel``: its help and its panel in
    ``meshtrain up``, where they differ."""
    return Flag(names, panel, commands, metavar=metavar, help=((UP, up_help),) if up_help else (),
                panels=((UP, up_panel),) if up_panel else ())


@dataclass
class HostKeys:
    """How a hosts command treats a host's SSH key (check, bench and up alike)."""

    accept_new_host_keys: bool = setting(
        False, "Trust hosts seen for the first time (records their keys).",
        flag=_flag(("--accept-new-host-keys",), CHECK, BENCH, HOSTS_SETUP, UP,
                   up_help="With --yes: trust machines seen for the first time (asked otherwise, "
                           "showing the key's fingerprint)."))


@dataclass
class Installing:
    """What ``hosts setup`` installs with on every host (``meshtrain up`` runs it as a step)."""

    base_python: str = setting(
        "python3", "Interpreter on the hosts that makes meshtrain's virtual environment (a name on "
                   "the host's PATH, or an absolute path).",
        flag=_flag(("--base-python",), HOSTS_SETUP, UP, up_panel=SETUP))
    pip_arg: list[str] = setting(
        None, "Extra argument for pip on the hosts, repeatable (e.g. "
              "--pip-arg=--index-url=https://mirror/simple for hosts behind a proxy).", factory=list,
        flag=_flag(("--pip-arg",), HOSTS_SETUP, UP, up_panel=SETUP))
    wheel: str | None = setting(
        None, "Ship this meshtrain wheel instead of one made from the meshtrain that runs here (it "
              "must be the same version).", flag=_flag(("--wheel",), HOSTS_SETUP, UP, up_panel=SETUP))


@dataclass
class HostsSetupSettings(Installing, HostKeys):
    """``meshtrain hosts setup``: how to install, and whether to point the inventory at it."""

    write_inventory: bool = setting(
        True, "Point the inventory's python: at the new environments (comments and layout kept).",
        flag=_flag(("--write-inventory/--no-write-inventory",), HOSTS_SETUP))
    timeout: float = setting(10.0, "Seconds to wait for each host to answer.", above=0,
                             flag=_flag(("--timeout",), HOSTS_SETUP))


@dataclass
class HostsCheckSettings(HostKeys):
    """``meshtrain hosts check``."""

    timeout: float = setting(10.0, "Seconds to wait for each host.", above=0,
                             flag=_flag(("--timeout",), CHECK))


@dataclass
class HostsBenchSettings(HostKeys):
    """``meshtrain hosts bench``: the all-reduce sizes, the compute probe, the file written."""

    min_size: str = setting("4KB", "Smallest all-reduce buffer (4096, 64KB, 1MiB).",
                            flag=_flag(("--min-size",), BENCH, panel=MEASURE))
    max_size: str = setting("16MB", "Largest all-reduce buffer: big enough that bandwidth, not "
                                    "latency, decides its time.",
                            flag=_flag(("--max-size",), BENCH, panel=MEASURE))
    points: int = setting(8, "Buffer sizes from --min-size to --max-size (log scale).",
                          flag=_flag(("--points",), BENCH, panel=MEASURE))
    repeats: int = setting(5, "Timed all-reduces per size (the median counts).", minimum=1,
                           flag=_flag(("--repeats",), BENCH, panel=MEASURE))
    shared_medium: bool = setting(
        False, "The hosts share one medium (Wi-Fi): the model then divides its bandwidth among the "
               "hosts talking at once.", flag=_flag(("--shared-medium",), BENCH, panel=MEASURE))
    speed: float = setting(1.0, "The hosts' compute speed relative to one core of this machine "
                                "(not measured).", minimum=1e-3, maximum=1e4,  # what a cluster file may say
                           flag=_flag(("--speed",), BENCH, panel=MEASURE))
    task: str | None = setting(
        None, "Compute probe: time a few steps of this task's model on every host; the slowest "
              "host's step goes into the cluster file (what `launch --strategy auto` plans with).",
        flag=_flag(("--task",), BENCH, panel=PROBE))
    data: str | None = setting(None, "The probe task's data file (same path on every host).",
                               flag=_flag(("--data",), BENCH, panel=PROBE))
    batch_size: int | None = setting(None, "The probe's samples per step (default: the task's).",
                                     minimum=1, flag=_flag(("--batch-size",), BENCH, panel=PROBE))
    threads: int | None = setting(None, "The probe's torch threads (default: the inventory's, else "
                                        "the host's cores, shared by its ranks).", minimum=1,
                                  flag=_flag(("--threads",), BENCH, panel=PROBE))
    out: str | None = setting(None, "Cluster file to write (default: clusters/NAME.yaml).",
                              flag=_flag(("--out",), BENCH, panel=CLUSTER_FILE))
    name: str | None = setting(None, "The cluster's name (default: the inventory's file name).",
                               flag=_flag(("--name",), BENCH, panel=CLUSTER_FILE))
    description: str | None = setting(None, "What the cluster is, in words.",
                                      flag=_flag(("--description",), BENCH, panel=CLUSTER_FILE))


@dataclass
class Listening:
    """How ``hosts discover`` and ``up`` look for machines, and log in to them."""

    # Its range (0 to 600 s) is checked by each command.
    timeout: float = setting(3.0, "Seconds to listen for announcements.",
                             flag=_flag(("--timeout",), DISCOVER, UP, panel=FINDING,
                                        up_help="Seconds to listen for machines."))
    iface: str | None = setting(None, "Listen on this network interface only (en0, eth0).",
                                flag=_flag(("--iface",), DISCOVER, UP, panel=FINDING))
    network: str | None = setting(None, "Keep only addresses in this range (192.168.1.0/24).",
                                  flag=_flag(("--network",), DISCOVER, UP, panel=FINDING))
    user: str | None = setting(None, "Login name for the inventory and --check-keys (default: yours "
                                     "here).", flag=_flag(("--user",), DISCOVER, UP, panel=FINDING,
                                                         up_help="Login name on the machines (default: "
                                                                 "yours here)."))
    identity_file: str | None = setting(None, "Private key to use (default: ssh-agent and ~/.ssh/id_*).",
                                        flag=_flag(("--identity-file",), DISCOVER, UP, panel=FINDING))
    known_hosts: str | None = setting(None, "known_hosts file (default ~/.ssh/known_hosts).",
                                      flag=_flag(("--known-hosts",), DISCOVER, UP, panel=FINDING))


@dataclass
class HostsDiscoverSettings(Listening):
    """``meshtrain hosts discover``: what to listen for, what to check, what to write."""

    write: str | None = setting(None, "Write a starter inventory here (hosts/NAME.yaml).",
                                flag=_flag(("--write",), DISCOVER))
    force: bool = setting(False, "Let --write replace an existing file.", flag=_flag(("--force",), DISCOVER))
    check_keys: bool = setting(
        False, "Try a public-key SSH login on every machine found (your agent or keys, your "
               "known_hosts; never a password; unknown host keys refused).",
        flag=_flag(("--check-keys",), DISCOVER))
    accepted_only: bool = setting(
        False, "With --check-keys: list and write only the machines that accepted the key.",
        flag=_flag(("--accepted-only",), DISCOVER))
    python: str | None = setting(None, "Interpreter path on the hosts for the inventory (default: this "
                                       "one's path).", flag=_flag(("--python",), DISCOVER))


#: What ``meshtrain up`` fine-tunes unless told otherwise.
UP_PROFILE = "whisper-tiny-lora"


@dataclass
class UpSettings(Listening, Installing, HostKeys):
    """``meshtrain up``: the whole path, from finding the machines to training on them."""

    yes: bool = setting(False, "Ask nothing: use every machine that lets us in, install, measure, "
                               "plan and train.", flag=_flag(("--yes", "-y"), UP))
    name: str = setting("lan", "Names the files written: hosts/NAME.yaml, clusters/NAME.yaml, "
                               "profiles/NAME.yaml.", flag=_flag(("--name",), UP))
    force: bool = setting(False, "Replace those files if they exist (asked otherwise; refused with "
                                 "--yes).", flag=_flag(("--force",), UP))
    dashboard: bool = setting(True, "Serve the live web dashboard of the training (needs "
                                    "meshtrain[dashboard]).",
                              flag=_flag(("--dashboard/--no-dashboard",), UP))
    profile: str = setting(UP_PROFILE, "What to fine-tune: a profile name or file (the planner "
                                       "chooses its strategy).",
                           flag=_flag(("--profile", "-p"), UP, panel=TRAINING))
    data: str | None = setting(None, "Data file or folder (for Whisper: recordings).",
                               flag=_flag(("--data",), UP, panel=TRAINING))
    set_: list[str] = setting(None, "Override a setting of the profile: key=value (steps=200, "
                                    "task_options.model=DIR).", factory=list,
                              flag=_flag(("--set",), UP, panel=TRAINING))
    workdir: str = setting("~/meshtrain-runs", "Folder on the machines for the environment, data and "
                                               "runs.", flag=_flag(("--workdir",), UP, panel=SETUP))
