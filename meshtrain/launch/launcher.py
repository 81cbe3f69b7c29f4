"""Start one rank per host over SSH, stream their output, and tear everything down.

    inventory = load_inventory("hosts/macs.yaml")
    argv = training_argv(["--strategy", "diloco", "--steps", "100"])
    result = launch(inventory, argv, LaunchOptions(run_id=new_launch_id("diloco", 3)))

Each rank is ``cd WORKDIR && RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. ... PYTHON ARGS`` on
its host, under a pty. The first rank that fails (exits non-zero, or its host stops
answering) stops every other rank: Ctrl-C on its pty, then SIGTERM and SIGKILL to its
process group, then the connection closes (SIGHUP to anything left). Ctrl-C or
SIGTERM on the launcher does the same. When all ranks succeed, rank 0's run
directory is copied back to the launching machine.

With ``max_restarts`` a failed run starts again from the newest checkpoint every host
holds; with ``allow_shrink`` too, a host that stays unreachable through the restart wait
is left out and the others continue without it, renumbered in inventory order.
"""

from __future__ import annotations

import functools
import json
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import paramiko

from meshtrain.comm.elastic import add_slot, mark_reachable
from meshtrain.comm.membership import Growth
from meshtrain.comm.rendezvous import PEERS_ENV, SECRET_FILE_ENV, SECRET_FOLDER_PREFIX, new_secret
from meshtrain.comm.sealing import ADVERTISE_ENV, GLOO_HINT, interface_environment
from meshtrain.config.environment import ELASTIC_ENV, HOST_NAMES_ENV, JOINING_ENV
from meshtrain.config.launching import REJOIN_BACKOFF_S, RESTART_WAIT_S
from meshtrain.config.settings import check_run_id
from meshtrain.errors import InputError
from meshtrain.heartbeat import EXIT_GRACE_S, HEARTBEAT_FD, heartbeat_interval
from meshtrain.hosts.host_output import host_json, visible
from meshtrain.hosts.inventory import Host, Inventory
from meshtrain.hosts.safe_copy import CopyLimits, UnsafeRunDirectory
from meshtrain.hosts.shipping import ShipError, Shipment, ship_to_hosts
from meshtrain.hosts.ssh import (
    UNREPORTED,
    EnvAssignment,
    Heartbeat,
    HostPath,
    OutputTooLarge,
    RemoteProcess,
    Shell,
    SSHError,
    connect,
    run,
    sh,
    shell_line,
)
from meshtrain.hosts.transfer import (
    TransferError,
    fetch_tree,
    has_sftp,
    has_tar,
    put_files,
    remote_dir_exists,
    sftp_path,
)
from meshtrain.launch.adding import (
    HostAdder,
    RunControl,
    drop_if_only_control,
    keep_control,
    launcher_address,
    only_control,
)
from meshtrain.launch.output import STOPPED, RankOutput
from meshtrain.launch.rejoin import RankHistory, Rejoiner, restart_as_joiner, wait_briefly
from meshtrain.run_dir import atomic_write_text

POLL_SECONDS = 0.1
#: ``--elastic``: the run finished, but without some host (lost and not back in time).
FINISHED_WITHOUT = 3
REMOTE_RUNS = "runs"  # under each host's workdir: where rank 0 writes <run_id>/


@dataclass
class LaunchOptions:
    """How to launch (the inventory says where)."""

    run_id: str
    out_dir: Path = Path("runs")  # local folder the run directory is copied back into
    accept_new_host_keys: bool = False
    uploads: list[Path] = field(default_factory=list)  # local files put in every workdir first
    connect_timeout: float = 10.0
    host_timeout: float = 6.0  # a host that answers nothing this long has dropped
    grace: float = 2.0  # seconds from Ctrl-C to SIGTERM, and from SIGTERM to SIGKILL
    resume: bool = False  # continue run_id from the newest checkpoint every host holds
    max_restarts: int = 0  # after a failure, start every rank again from that checkpoint
    restart_wait: float = RESTART_WAIT_S  # before a restart: how long a cut-off host may take
    allow_shrink: bool = False  # a host still cut off after restart_wait is left out
    elastic: bool = False  # a lost rank but 0's is retried over SSH and rejoins (launch/rejoin.py)
    rejoin_backoff: float = REJOIN_BACKOFF_S  # with elastic: the longest wait between two tries
    shipments: list[Shipment] = field(default_factory=list)  # local data sent into every workdir first
    # (what, path) every host must already hold, relative to its workdir (launch --no-ship)
    required_paths: list[tuple[str, str]] = field(default_factory=list)
    copy_limits: CopyLimits = field(default_factory=CopyLimits)  # what rank 0's host may send back
    # the program a script command runs (not python, not an upload): found on every host
    # before any rank starts, so `-- nosuchprog` is bad input rather than N failed ranks
    program: str | None = None

    def __post_init__(self) -> None:
        check_run_id(self.run_id)  # a folder name on every host, in remote commands: never shell text


@dataclass
class RankFailure:
    """Why a rank stopped the run."""

    rank: int
    host: Host
    reason: str  # "exited with status 1", "lost connection", ...
    tail: list[str]


@dataclass
class LaunchResult:
    """How a launch ended."""

    exit_code: int  # 0 ok, 1 a rank failed, 128+N stopped by signal N
    failures: list[RankFailure]
    run_dir: Path | None  # the local copy of rank 0's run directory, if any
    seconds: float
    teardown_seconds: float | None = None  # from the failure (or signal) to every rank stopped
    leftovers: list[str] = field(default_factory=list)  # ranks that could not be confirmed stopped
    copy_failed: bool = False  # every rank succeeded but the run directory could not be copied back
    restarts: list[dict[str, object]] = field(default_factory=list)  # each restart: why, from which step
    lost: list[int] = field(default_factory=list)  # the ranks in leftovers: their hosts stayed unreachable
    resumed_at: int | None = None  # the checkpoint step this attempt started from
    world_size: int = 0  # ranks of the last attempt (fewer than the inventory's after a shrink)
    started: bool = True  # False: stopped before any rank of this launch started
    history: list[RankHistory] = field(default_factory=list)  # --elastic: ranks lost (and rejoined)
    left_out: list[str] = field(default_factory=list)  # --elastic: hosts not in the run at its end
    added: list[Host] = field(default_factory=list)  # --elastic: hosts `hosts add` brought in


class PreflightError(InputError, RuntimeError):
    """Some hosts are not ready; nothing was started. One line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def new_launch_id(label: str, world_size: int, out_dir: Path = Path("runs")) -> str:
    """``YYYYmmdd-HHMMSS-<label>-<n>h``, unique in ``out_dir`` (n hosts)."""
    base = f"{time.strftime('%Y%m%d-%H%M%S')}-{label}-{world_size}h"
    run_id, n = base, 1
    while (out_dir / run_id).exists():
        n += 1
        run_id = f"{base}-{n}"
    return run_id


# --------------------------------------------------------------------------- commands
def training_argv(flags: list[str]) -> list[str]:
    """Arguments after the interpreter for ``meshtrain simulate`` as a launched rank.

    The launcher adds --device, --out and --run-id per host in :func:`rank_command`.
    """
    return ["-m", "meshtrain", "simulate", *flags]


def secret_folder_name(run_id: str, rank: int) -> str:
    """The private folder (in the rank's workdir) that holds the launch secret until the
    rank reads it; made by the launcher, mode 0700."""
    return f"{SECRET_FOLDER_PREFIX}{run_id}-{rank}"


def secret_file_name(run_id: str, rank: int) -> str:
    """The file, relative to the rank's workdir, that holds the launch secret."""
    return f"{secret_folder_name(run_id, rank)}/secret"


#: Run by the host's interpreter in the workdir: makes the private folder (or accepts one
#: that is already this user's and private, left by an earlier attempt, and removes what
#: is at the file's name there), then creates the secret file in it without following a
#: symlink and only if it does not exist. The secret comes on stdin.
WRITE_SECRET = """\
import os, stat, sys
folder = sys.argv[1]
try:
    os.mkdir(folder, 0o700)
except FileExistsError:
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        sys.exit(folder + " already exists and is not a private folder of this user's")
path = os.path.join(folder, "secret")
try:  # a stale secret (an attempt whose rank never read it): only we can write here
    os.unlink(path)  # a link is removed, never followed
except FileNotFoundError:
    pass
flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
try:
    fd = os.open(path, flags, 0o600)
except OSError as exc:
    sys.exit(path + ": " + exc.strerror)
with os.fdopen(fd, "wb") as out:
    out.write(sys.stdin.buffer.read())
"""

#: Run by the host's interpreter: exits non-zero (saying why) when another user could
#: plant files in the workdir: it is another user's, or group/other-writable without the
#: sticky bit.
CHECK_WORKDIR = """\
import os, stat, sys
info = os.stat(sys.argv[1])
if info.st_uid != os.geteuid():
    sys.exit(f"is owned by another user (uid {info.st_uid})")
if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
    sys.exit(f"is writable by other users (mode {stat.S_IMODE(info.st_mode):o}, no sticky bit)")
"""


def deliver_secret(client: paramiko.SSHClient, host: Host, run_id: str, secret: str, timeout: float) -> None:
    """Write the launch secret into a fresh private folder in ``host``'s workdir, over
    SSH's stdin: never on a command line, where ``ps`` would show it. A symlink or a
    folder another user planted at that name is refused, and nothing is written."""
    done = run(client, sh(shell_line(
        "cd", HostPath(host.workdir), Shell("&& umask 077 &&"),
        HostPath(host.python), "-c", WRITE_SECRET, secret_folder_name(run_id, host.rank),
    )), timeout=timeout, stdin=secret.encode())
    if done.status != 0:
        why = (done.stderr.strip().splitlines() or ["no reason given"])[-1]
        raise SSHError(host, f"cannot write the launch secret in {host.workdir}: {why}")


def _forget_secret(client: paramiko.SSHClient, host: Host, run_id: str) -> None:
    """Remove the secret's folder if the rank never read it (a script that does not use
    meshtrain). ``rm -rf`` on the name itself: a symlink there is removed, not followed."""
    folder = HostPath(f"{host.workdir}/{secret_folder_name(run_id, host.rank)}")
    try:
        run(client, sh(shell_line("rm", "-rf", folder)), timeout=5)
    except Exception:  # noqa: BLE001 - best effort on a host that may be gone
        pass


def rank_env(inventory: Inventory, host: Host, run_id: str, *, elastic: bool = False,
             joining: bool = False) -> dict[str, str]:
    """The environment of ``host``'s rank: torchrun's variables plus meshtrain's (``elastic``:
    the heartbeat that loses a rank; ``joining``: a rank started again to rejoin)."""
    same_machine = [h for h in inventory.hosts if h.hostname == host.hostname]
    env = dict(host.env)
    env.update({
        "RANK": str(host.rank),
        "WORLD_SIZE": str(inventory.world_size),
        "LOCAL_RANK": str(same_machine.index(host)),
        "LOCAL_WORLD_SIZE": str(len(same_machine)),
        "MASTER_ADDR": inventory.master.advertise,
        "MASTER_PORT": str(inventory.rendezvous.port),
        "MESHTRAIN_TIMEOUT": f"{inventory.rendezvous.timeout:g}",
        "MESHTRAIN_RUN_ID": run_id,
        SECRET_FILE_ENV: secret_file_name(run_id, host.rank),
        "PYTHONUNBUFFERED": "1",
        HOST_NAMES_ENV: ",".join(h.name for h in sorted(inventory.hosts, key=lambda h: h.rank)),
    })
    if host.rank == 0:  # the rendezvous gate admits connections from these hosts only
        peers = [" ".join(dict.fromkeys((h.advertise, h.hostname))) for h in inventory.hosts if h.rank != 0]
        if elastic:  # and from the launcher, which passes it (with the secret) to add a host
            me = launcher_address(inventory.master.advertise, inventory.rendezvous.port)
            peers += [me] if me else []
        env[PEERS_ENV] = ",".join(peers)
    if host.iface:  # an NCCL_SOCKET_IFNAME in the host's env wins (a prefix for several, say)
        for key, value in interface_environment(host.iface).items():
            env.setdefault(key, value)
    else:  # the rank finds the interface that holds this address, and gloo listens there only
        env[ADVERTISE_ENV] = host.advertise
    if host.threads is not None:
        env["MESHTRAIN_THREADS"] = str(host.threads)
    # The rank proves it is alive (not stopped, not hung) by beating on fd 3: see heartbeat.py.
    env["MESHTRAIN_HEARTBEAT"] = f"{heartbeat_interval(inventory.rendezvous.heartbeat_timeout):g}"
    env["MESHTRAIN_HEARTBEAT_FD"] = str(HEARTBEAT_FD)
    if elastic:
        env[ELASTIC_ENV] = f"{inventory.rendezvous.heartbeat_timeout:g}"
    if joining:
        env[JOINING_ENV] = "1"
    return env


def rank_command(inventory: Inventory, host: Host, run_id: str, argv: list[str], *,
                 training: bool, elastic: bool = False, joining: bool = False) -> str:
    """The shell line that runs ``host``'s rank in its workdir.

    Variables go on the command line as sh assignments (``K=V PROGRAM``): sshd passes
    few or none from the client's environment (AcceptEnv). Not ``env K=V PROGRAM``: env
    (GNU and BSD alike) takes any argument with a ``=`` for one more assignment, so an
    interpreter at ``/opt/a=b/python`` would never run; sh only takes unquoted
    ``NAME=`` words, and the program path always starts with ``/`` or ``~``. In a
    script command a leading ``python`` or ``python3`` means the host's interpreter
    from the inventory.
    """
    env = [EnvAssignment(k, v) for k, v in rank_env(inventory, host, run_id, elastic=elastic,
                                                    joining=joining).items()]
    args = list(argv)
    if training:
        args += ["--device", host.device, "--out", REMOTE_RUNS, "--run-id", run_id]
        program = [host.python]
    elif args and args[0] in ("python", "python3"):
        program, args = [host.python], args[1:]
    else:
        program = []
    return shell_line("cd", HostPath(host.workdir), Shell("&&"), *env, *map(HostPath, program), *args)


# --------------------------------------------------------------------------- preflight
#: The preflight's interpreter check may take this long: a cold interpreter on a network
#: home or a sleeping disk takes well over the 10 s a connection gets.
INTERPRETER_START_S = 60.0


def preflight(inventory: Inventory, options: LaunchOptions) -> list[paramiko.SSHClient]:
    """One authenticated connection per rank, each host's interpreter and workdir checked.

    Raises :class:`PreflightError` listing every host that is not ready.
    """
    def prepare(host: Host) -> paramiko.SSHClient:
        client = connect(host, accept_new_host_keys=options.accept_new_host_keys,
                         timeout=options.connect_timeout)
        try:
            words: list[str] = [
                "test", "-x", HostPath(host.python), Shell("|| exit 41;"),
                "mkdir", "-p", HostPath(host.workdir), Shell("|| exit 42;"),
                HostPath(host.python), "-c", CHECK_WORKDIR, HostPath(host.workdir), Shell("|| exit 43;"),
                "mkdir", "-p", HostPath(f"{host.workdir}/{REMOTE_RUNS}"), Shell("|| exit 42"),
            ]
            if options.program:  # where the rank runs it: in the workdir, on the login PATH
                words += [Shell("; cd"), HostPath(host.workdir), Shell("&& command -v"), options.program,
                          Shell(">/dev/null 2>&1 || exit 44")]
            check = run(client, sh(shell_line(*words)), timeout=max(options.connect_timeout,
                                                                    INTERPRETER_START_S))
        except TimeoutError:  # paramiko's socket.timeout says nothing ("TimeoutError: ")
            client.close()
            raise SSHError(host, f"python {host.python} did not start and check workdir {host.workdir} "
                                 f"within {max(options.connect_timeout, INTERPRETER_START_S):g} s: the "
                                 "interpreter hangs or its disk does not answer (run it there by hand)"
                           ) from None
        except Exception:
            client.close()
            raise
        if check.status != 0:
            client.close()
            if check.status == 41:
                raise SSHError(host, f"python {host.python} not found or not executable: set 'python' in "
                                     "the inventory to the absolute interpreter path (`which python3` "
                                     "on the host)")
            if check.status == 43:
                why = (check.stderr.strip().splitlines() or ["is not private"])[-1]
                raise SSHError(host, f"refusing workdir {host.workdir}: it {why}; another user could "
                                     "plant files there (use a folder of your own)")
            if check.status == 44:
                raise SSHError(host, f"program {options.program!r} not found there (in workdir "
                                     f"{host.workdir} or on PATH): install it, or --upload it")
            raise SSHError(host, f"cannot create workdir {host.workdir}: {check.stderr.strip()}")
        try:
            _check_required_paths(client, host, options)
        except Exception:
            client.close()
            raise
        return client

    clients: list[paramiko.SSHClient | None] = [None] * inventory.world_size
    problems: list[str] = []
    with ThreadPoolExecutor(max_workers=min(16, inventory.world_size)) as pool:
        futures = [pool.submit(prepare, h) for h in inventory.hosts]
        for host, future in zip(inventory.hosts, futures, strict=True):
            try:
                clients[host.rank] = future.result()
            except SSHError as exc:
                problems.append(str(exc))
            except Exception as exc:  # noqa: BLE001 - reported as one line per host
                problems.append(f"{host.name} ({host.label}): {type(exc).__name__}: {exc}")
    if problems:
        for c in clients:
            if c is not None:
                c.close()
        raise PreflightError(problems)
    return clients


def _check_required_paths(client: paramiko.SSHClient, host: Host, options: LaunchOptions) -> None:
    """With ``--no-ship`` the data must already be on every host, where the rank looks."""
    if not options.required_paths:
        return
    tests = [shell_line("test", "-e", HostPath(path), Shell("||"), "echo", f"{what} {path}")
             for what, path in options.required_paths]
    found = run(client, sh(shell_line("cd", HostPath(host.workdir), Shell("&& {"), Shell("; ".join(tests)),
                                      Shell("; }"))), timeout=options.connect_timeout)
    absent = found.stdout.strip().splitlines()
    if absent:
        raise SSHError(host, f"{absent[0]} does not exist there (relative paths start at workdir "
                             f"{host.workdir}); with --no-ship every host needs it at that path")


def upload(client: paramiko.SSHClient, host: Host, files: list[Path],
           check_stop: Callable[[], None] = lambda: None) -> None:
    """Put local files into ``host``'s workdir (e.g. the script a command runs); a copy the
    host refuses (its disk full, a folder in the way) is a :class:`PreflightError` naming
    the host and the file: nothing has started yet."""
    if not files:
        return
    try:
        put_files(client, host.workdir, files, use_sftp=has_sftp(client), check_stop=check_stop)
    except (OSError, EOFError, paramiko.SSHException, TransferError) as exc:
        # SFTP's errors say little ("Failure"): the file and the folder say where to look.
        reason = (exc.strerror or "") if isinstance(exc, OSError) else str(exc)
        raise PreflightError([visible(f"{host.name} ({host.label}): cannot upload "
                                      f"{', '.join(f.name for f in files)} into {host.workdir}: "
                                      f"{reason or type(exc).__name__} (is the host's disk full, or "
                                      "something of that name in the way?)")]) from None


# --------------------------------------------------------------------------- launching
@dataclass
class _Rank:
    host: Host
    client: paramiko.SSHClient
    row: int  # the host's line in the output (its inventory position: ranks change on a shrink)
    process: RemoteProcess | None = None
    heartbeat: Heartbeat | None = None
    outcome: str | None = None  # None while running; "ok" or a failure reason


def launch(inventory: Inventory, argv: list[str], options: LaunchOptions, *, training: bool,
           output: RankOutput | None = None) -> LaunchResult:
    """Run one rank per host and wait for all of them; see the module docstring.

    With ``options.max_restarts``, a failed training run starts again on every host
    from the newest checkpoint all hosts hold (from step 0 if there is none yet), up to
    that many times; each restart is reported and listed in ``restarts``.

    Raises :class:`PreflightError` (nothing started) when a host is not ready.
    """
    started = time.monotonic()
    output = output or RankOutput([h.name for h in inventory.hosts])
    # --elastic: the local run directory holds the control folder `hosts add` writes into.
    control = RunControl.claim(options.out_dir / options.run_id, options.run_id, inventory) \
        if options.elastic and training else None
    try:
        with _stop_on_signals() as stop:  # from the first connection to the last byte copied back
            result, restarts = _attempts(inventory, argv, options, output, stop, training=training,
                                         control=control)
    finally:
        if control is not None:
            control.finished(options.run_id)
            drop_if_only_control(options.out_dir / options.run_id)  # no run came back: no run directory
    result.restarts = restarts
    if restarts and result.run_dir is not None:
        _record_restarts(result.run_dir, restarts)
    result.seconds = time.monotonic() - started
    return result


def _attempts(inventory: Inventory, argv: list[str], options: LaunchOptions, output: RankOutput,
              stop: _Signal, *, training: bool,
              control: RunControl | None = None) -> tuple[LaunchResult, list[dict[str, object]]]:
    """The first attempt and the restarts after it: the last one's result, and every restart."""
    restarts: list[dict[str, object]] = []
    resume = options.resume
    while True:
        may_restart = training and len(restarts) < options.max_restarts
        try:
            result = _launch_once(inventory, argv, options, output, stop, training=training, resume=resume,
                                  restarting=bool(restarts), may_restart=may_restart, control=control)
        except Interrupted as exc:  # before this attempt's ranks started (they run in _run_ranks)
            output.note(f"{signal.Signals(exc.signum).name} received while preparing the hosts; no rank "
                        "is running", style="bold yellow")
            return LaunchResult(128 + exc.signum, [], None, 0.0, started=bool(restarts),
                                world_size=inventory.world_size), restarts
        if restarts and "shrunk_to" in restarts[-1]:
            restarts[-1]["at_step"] = result.resumed_at or 0
        can_restart = training and result.exit_code == 1 and not result.copy_failed
        if not can_restart or len(restarts) >= options.max_restarts:
            break
        why = result.failures[0]
        event: dict[str, object] = {"rank": why.rank, "host": why.host.name, "reason": why.reason}
        if result.leftovers:  # a rank may still be running: a second copy must not join it
            smaller = _shrunk(inventory, result.lost, options, output)
            if smaller is None:
                break
            dropped = [inventory.hosts[rank].name for rank in sorted(result.lost)]
            inventory = smaller
            event.update(shrunk_to=inventory.world_size, dropped=", ".join(dropped))
        restarts.append(event)
        output.note(f"restart {len(restarts)} of {options.max_restarts}: starting every rank again "
                    "from the last checkpoint", style="bold yellow")
        resume = True
    result.world_size = result.world_size or inventory.world_size  # --elastic: hosts added count too
    return result, restarts


def _shrunk(inventory: Inventory, lost: list[int], options: LaunchOptions,
            output: RankOutput) -> Inventory | None:
    """The inventory without the hosts that stayed unreachable, ranks renumbered in
    inventory order; None (said why) when the run cannot go on without them.

    A rank left running on such a host cannot disturb the smaller run: every attempt has
    a new rendezvous secret, and that host's rank writes only into its own workdir.
    """
    if not options.allow_shrink:
        output.note("not restarting: some ranks could not be confirmed stopped", style="bold red")
        return None
    if 0 in lost:  # rank 0's host holds the run directory and rank 0's checkpoints
        output.note(f"not continuing without rank 0's host {inventory.hosts[0].name}: it holds the run "
                    "directory and rank 0's checkpoints", style="bold red")
        return None
    kept = [h for h in inventory.hosts if h.rank not in lost]
    hosts = tuple(replace(h, rank=rank) for rank, h in enumerate(kept))
    gone = ", ".join(inventory.hosts[rank].name for rank in sorted(lost))
    output.note(f"continuing on {len(hosts)} hosts without {gone}", style="bold yellow")
    return replace(inventory, hosts=hosts)


def _launch_once(inventory: Inventory, argv: list[str], options: LaunchOptions, output: RankOutput,
                 stop: _Signal, *, training: bool, resume: bool, restarting: bool,
                 may_restart: bool, control: RunControl | None = None) -> LaunchResult:
    """One attempt: preflight every host, start the ranks, wait for them. A signal before
    the ranks start raises :class:`Interrupted` at the next poll."""
    stop.check()
    clients = preflight(inventory, options)
    ranks = [_Rank(h, c, output.names.index(h.name)) for h, c in zip(inventory.hosts, clients, strict=True)]
    secret = new_secret()  # this launch's: only its ranks can join its rendezvous
    step = None
    try:
        if resume:
            step, skipped = newest_intact_checkpoint(ranks, options)
            if step is None and not restarting:
                raise PreflightError([f"--resume {options.run_id}: no checkpoint that every host holds "
                                      f"intact (in {REMOTE_RUNS}/{options.run_id}.checkpoints/ of each "
                                      "workdir)", *(f"skipped {why}" for why in skipped)])
            for why in skipped:
                output.note(f"skipped the checkpoint at {why}", style="bold yellow")
            _forget_unfinished_run(ranks[0], options)
            if step is None:
                output.note("no checkpoint yet: starting again from step 0", style="bold yellow")
            else:
                output.note(f"resuming {options.run_id} after step {step} (the newest checkpoint every "
                            "host holds)", style="bold")
                argv = [*argv, "--resume", f"{_checkpoints(options)}/step-{step:06d}"]
        stop.check()
        if options.shipments:
            try:
                ship_to_hosts([(r.host, r.client) for r in ranks], options.shipments, output.note,
                              check_stop=stop.check)
            except ShipError as exc:
                raise PreflightError(exc.problems) from None
        for r in ranks:
            upload(r.client, r.host, options.uploads, check_stop=stop.check)
            deliver_secret(r.client, r.host, options.run_id, secret, options.connect_timeout)
        stop.check()
        result = _run_ranks(inventory, ranks, argv, options, output, stop, training=training,
                            may_restart=may_restart, secret=secret, control=control)
        result.resumed_at = step
        return result
    finally:
        for r in ranks:
            if r.heartbeat is not None:
                r.heartbeat.stop()
            if not _host_gone(r, options):  # asking a host that stopped answering only waits
                _forget_secret(r.client, r.host, options.run_id)
            r.client.close()


def _host_gone(r: _Rank, options: LaunchOptions) -> bool:
    """Whether ``r``'s host stopped answering its connection's heartbeat (cut off, down)."""
    return r.heartbeat is not None and r.heartbeat.silent_for() > options.host_timeout


def _checkpoints(options: LaunchOptions) -> str:
    """Where each rank keeps its checkpoints, relative to its workdir."""
    return f"{REMOTE_RUNS}/{options.run_id}.checkpoints"


SUMMARY_MAX_BYTES = 16 << 20  # a copied-back summary.json the launcher adds its restarts to
STEP_NUMBER = re.compile(r"^[0-9]{1,12}$")  # a checkpoint step a host lists
LISTING_MAX_BYTES = 1 << 20  # a host's checkpoint listing: far more than any real one


#: Run by each host's interpreter in its checkpoint folder: every ``step-N`` folder with a
#: meta.json, checked as a rank checks it before resuming (meta.json readable and naming
#: the folder's step, each node file present and matching its SHA-256), answered as
#: ``N:ok``, ``N:meta``, ``N:missing`` or ``N:checksum``, each followed by ``/``.
CHECK_CHECKPOINTS = """\
import hashlib, json, os, re, sys
for name in sorted(os.listdir(".")):
    found = re.fullmatch(r"step-([0-9]{1,12})", name)
    if not found or not os.path.isfile(os.path.join(name, "meta.json")):
        continue
    step, why = int(found.group(1)), "ok"
    try:
        with open(os.path.join(name, "meta.json"), "rb") as f:
            meta = json.loads(f.read(1 << 20))
        files = meta["files"]
        if int(meta["step"]) != step or not isinstance(files, dict):
            why = "meta"
    except Exception:
        why = "meta"
    for file, digest in (files.items() if why == "ok" else ()):
        path = os.path.join(name, str(file))
        if "/" in str(file) or not os.path.isfile(path):
            why = "missing"
            break
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() != digest:
            why = "checksum"
            break
    sys.stdout.write("%d:%s/" % (step, why))
"""
#: What a host's answer code says of a checkpoint it holds.
DAMAGE = {"meta": "its meta.json is damaged", "missing": "a node file is missing",
          "checksum": "its node file does not match its checksum"}
#: Checking means hashing every checkpoint a host keeps: more than a question's usual time.
CHECK_TIMEOUT_S = 300.0


def common_checkpoint(ranks: list[_Rank], options: LaunchOptions) -> int | None:
    """The newest checkpoint step that every host holds intact, or None."""
    return newest_intact_checkpoint(ranks, options)[0]


def newest_intact_checkpoint(ranks: list[_Rank], options: LaunchOptions) -> tuple[int | None, list[str]]:
    """The newest checkpoint step that every host holds intact (each host keeps only its
    own rank's state, so all must have it), and why each newer one some host holds was
    skipped ("step 60: its node file does not match its checksum on box1"): a damaged
    newest checkpoint is passed over for the one before, not chosen again on every resume."""
    held: list[dict[int, str]] = []
    for r in ranks:
        try:
            found = run(r.client, sh(shell_line(
                "cd", HostPath(r.host.workdir), Shell("2>/dev/null || exit 0;"),
                "cd", _checkpoints(options), Shell("2>/dev/null || exit 0;"),
                "exec", HostPath(r.host.python), "-c", CHECK_CHECKPOINTS,
            )), timeout=max(options.connect_timeout, CHECK_TIMEOUT_S), max_output=LISTING_MAX_BYTES)
        except OutputTooLarge:
            return None, [f"{r.host.name} answered with more than {LISTING_MAX_BYTES} bytes"]
        # The host's answer is hostile input: only a plain step number and a known code count.
        answer: dict[int, str] = {}
        for item in found.stdout.split("/"):
            number, _, code = item.strip().partition(":")
            if STEP_NUMBER.fullmatch(number) and (code == "ok" or code in DAMAGE):
                answer[int(number)] = code
        held.append(answer)
    intact = set.intersection(*({s for s, code in a.items() if code == "ok"} for a in held)) if held \
        else set()
    chosen = max(intact) if intact else None
    skipped: list[str] = []
    for step in sorted({s for a in held for s in a}, reverse=True):
        if chosen is not None and step <= chosen:
            break
        why = [f"{DAMAGE[a[step]]} on {r.host.name}" for r, a in zip(ranks, held, strict=True)
               if a.get(step, "ok") != "ok"]
        why += [f"{r.host.name} does not hold it" for r, a in zip(ranks, held, strict=True) if step not in a]
        skipped.append(f"step {step}: {'; '.join(why)}")
    return chosen, skipped


def _forget_unfinished_run(rank0: _Rank, options: LaunchOptions) -> None:
    """Remove the hidden run directory a stopped rank 0 left, so the run id can be used
    again (every rank was confirmed stopped before a restart or a resume)."""
    partial = HostPath(f"{rank0.host.workdir}/{REMOTE_RUNS}/.{options.run_id}.partial")
    run(rank0.client, sh(shell_line("rm", "-rf", partial)), timeout=options.connect_timeout)


def _record_restarts(run_dir: Path, restarts: list[dict[str, object]]) -> None:
    """Add the restarts to the copied-back run's summary.json (``"restarts"``)."""
    summary_file = run_dir / "summary.json"
    if summary_file.is_file() and summary_file.stat().st_size < SUMMARY_MAX_BYTES:
        try:  # written by rank 0's host: a summary that is not a JSON object is left as it came
            summary = host_json(summary_file.read_text())
        except (ValueError, UnicodeDecodeError):
            return
        summary["restarts"] = restarts
        atomic_write_text(summary_file, json.dumps(summary, indent=2) + "\n")


def _run_ranks(inventory: Inventory, ranks: list[_Rank], argv: list[str], options: LaunchOptions,
               output: RankOutput, stop: _Signal, *, training: bool,
               may_restart: bool = False, secret: str = "",
               control: RunControl | None = None) -> LaunchResult:
    failures: list[RankFailure] = []
    elastic = options.elastic and training
    current = [inventory]  # --elastic: grows with every host added (`hosts add`)
    rejoiner = _rejoiner(lambda: current[0], argv, options, output, secret) if elastic else None
    adder = _adder(current, ranks, argv, options, output, secret, rejoiner, control) \
        if rejoiner is not None and control is not None else None
    try:
        for r in ranks:
            command = rank_command(inventory, r.host, options.run_id, argv, training=training,
                                   elastic=elastic)
            r.process = RemoteProcess(r.client, command, functools.partial(output.line, r.row))
            r.heartbeat = Heartbeat(r.client)
            output.watch(r.row, r.process)  # the live view shows its heartbeats
    except Exception as exc:  # noqa: BLE001 - a host dropped while starting: stop the others
        r.outcome = f"could not start: {exc}"
        failures.append(RankFailure(r.host.rank, r.host, r.outcome, []))

    while not failures and stop.signum is None:
        for r in ranks:
            if r.outcome is None:
                r.outcome = _outcome(r, options, inventory.rendezvous.heartbeat_timeout)
                if r.outcome is not None:
                    output.ended(r.row, r.outcome)
                if r.outcome is not None and r.outcome != "ok":
                    tail = output.tail(r.row)
                    r.outcome = _with_likely_cause(r.outcome, tail)
                    if rejoiner is not None and r.host.rank != 0 and ranks[0].outcome is None:
                        rejoiner.lost(r, r.outcome)  # the others go on; it is tried again
                        continue
                    failures.append(RankFailure(r.host.rank, r.host, r.outcome, tail))
        if adder is not None:
            adder.poll()
        if rejoiner is not None and ranks[0].outcome == "ok":
            if adder is not None:
                adder.stop()
            result = _finish_elastic(ranks, rejoiner, options, output, stop)
            result.added = list(adder.added) if adder is not None else []
            return result
        if all(r.outcome == "ok" for r in ranks):
            _teardown(ranks, options)  # anything the ranks left running in the background
            return _copy_back(ranks[0], options, output, stop)
        if not failures:
            time.sleep(POLL_SECONDS)

    if rejoiner is not None:
        rejoiner.stop()
    if adder is not None:
        adder.stop()
    why = failures[0] if failures else None
    if why is not None:
        output.note(f"rank {why.rank} on {why.host.name} {why.reason}; stopping the other ranks",
                    style="bold red")
    else:
        output.note(f"{signal.Signals(stop.signum).name} received; stopping every rank",  # type: ignore[arg-type]
                    style="bold yellow")
    t0 = time.monotonic()
    unconfirmed = _teardown(ranks, options)
    teardown_seconds = time.monotonic() - t0
    for r in ranks:  # the live view: who failed, and who was stopped because of it
        output.ended(r.row, r.outcome or STOPPED)
    output.note(f"all ranks stopped in {teardown_seconds:.1f} s" if not unconfirmed else
                "could not confirm these ranks stopped: " + "; ".join(unconfirmed.values()), style="bold")
    if unconfirmed and failures and may_restart:
        unconfirmed = _stop_when_back(ranks, unconfirmed, options, output, options.restart_wait)
    _report_incomplete(ranks[0], options, output)
    code = 1 if failures else 128 + int(stop.signum)  # type: ignore[arg-type]
    return LaunchResult(code, failures, None, 0.0, teardown_seconds, list(unconfirmed.values()),
                        lost=sorted(unconfirmed))


def _rejoiner(inventory: Callable[[], Inventory], argv: list[str], options: LaunchOptions,
              output: RankOutput, secret: str) -> Rejoiner:
    """``--elastic``: what tries a lost rank's host again and starts it as a joiner
    (``inventory``: the run's now, hosts added included)."""
    def connect_host(host: Host) -> paramiko.SSHClient:
        return connect(host, accept_new_host_keys=options.accept_new_host_keys,
                       timeout=min(3.0, options.connect_timeout))

    def start_rank(r: _Rank, client: paramiko.SSHClient) -> None:
        deliver_secret(client, r.host, options.run_id, secret, options.connect_timeout)
        command = rank_command(inventory(), r.host, options.run_id, argv, training=True, elastic=True,
                               joining=True)
        restart_as_joiner(r, client, command, functools.partial(output.line, r.row),
                          lambda process: output.watch(r.row, process))

    def reachable(host: Host) -> None:
        now = inventory()
        mark_reachable(now.master.advertise, now.rendezvous.port, secret.encode(), host.rank,
                       min(5.0, now.rendezvous.timeout))

    return Rejoiner(connect_host, start_rank, lambda line: output.note(line, style="bold yellow"),
                    options.rejoin_backoff, reachable)


def _adder(current: list[Inventory], ranks: list[_Rank], argv: list[str], options: LaunchOptions,
           output: RankOutput, secret: str, rejoiner: Rejoiner, control: RunControl) -> HostAdder:
    """``--elastic``: what brings in the hosts ``meshtrain hosts add`` asks for, each checked
    and readied over SSH as at launch, its rank started as a joiner (``current[0]``, the
    run's inventory, grows by it)."""
    def prepare(host: Host) -> paramiko.SSHClient:
        # The launch's own checks, on this host alone (preflight numbers its hosts from 0).
        client = preflight(replace(current[0], hosts=(replace(host, rank=0),)), options)[0]
        try:
            if options.shipments:
                ship_to_hosts([(host, client)], options.shipments, output.note)
            upload(client, host, options.uploads)
            deliver_secret(client, host, options.run_id, secret, options.connect_timeout)
        except ShipError as exc:
            client.close()
            raise PreflightError(exc.problems) from None
        except BaseException:
            client.close()
            raise
        return client

    def tell(host: Host) -> None:
        inventory = current[0]
        growth = Growth(host.rank, host.name, tuple(dict.fromkeys((host.advertise, host.hostname))))
        add_slot(inventory.master.advertise, inventory.rendezvous.port, secret.encode(), growth,
                 inventory.rendezvous.timeout)

    def start(host: Host, client: paramiko.SSHClient) -> None:
        current[0] = replace(current[0], hosts=(*current[0].hosts, host))
        r = _Rank(host, client, output.add_row(host.name))
        command = rank_command(current[0], host, options.run_id, argv, training=True, elastic=True,
                               joining=True)
        try:
            r.process = RemoteProcess(client, command, functools.partial(output.line, r.row))
            r.heartbeat = Heartbeat(client)
            output.watch(r.row, r.process)
        except Exception as exc:  # noqa: BLE001 - it is a slot of the run now: tried again as a lost one
            r.outcome = f"could not start: {exc}"
            ranks.append(r)
            rejoiner.lost(r, r.outcome)
            return
        ranks.append(r)  # the launch loop watches it from its next round

    return HostAdder(control, prepare, tell, start, lambda line: output.note(line, style="bold yellow"))


def _finish_elastic(ranks: list[_Rank], rejoiner: Rejoiner, options: LaunchOptions, output: RankOutput,
                    stop: _Signal) -> LaunchResult:
    """Rank 0 finished an elastic run: no more tries; the other ranks finish with it (a rank
    still waiting to rejoin is stopped); then the run directory comes back. Exit status
    :data:`FINISHED_WITHOUT` when a rank was not in at the end."""
    rejoiner.stop()
    wait_briefly(lambda: all(r.outcome is not None or (r.process is not None and r.process.finished)
                             for r in ranks), options.grace * 5)
    for r in ranks:
        if r.outcome is None and r.process is not None and r.process.finished:
            r.outcome = _outcome(r, options, 0.0)
    _teardown(ranks, options)
    missing = [r for r in ranks if r.outcome != "ok"]
    for r in ranks:
        output.ended(r.row, r.outcome or STOPPED)
    result = _copy_back(ranks[0], options, output, stop)
    result.history = list(rejoiner.history.values())
    result.left_out = [r.host.name for r in missing]
    result.world_size = len(ranks)
    if result.exit_code == 0 and missing:
        result.exit_code = FINISHED_WITHOUT
    return result


def _outcome(r: _Rank, options: LaunchOptions, heartbeat_timeout: float) -> str | None:
    """None while the rank runs; "ok"; or why it failed."""
    assert r.process is not None and r.heartbeat is not None
    if r.process.finished:
        status = r.process.exit_status()
        if status is None:
            return "lost connection (host down, asleep, or off the network)"
        if status == UNREPORTED:
            return "ended without reporting its exit status (its remote shell was killed)"
        return "ok" if status == 0 else f"exited with status {status}"
    silent = r.heartbeat.silent_for()
    if silent > options.host_timeout:
        return f"stopped answering for {silent:.0f} s (host down or off the network)"
    quiet = r.process.beat_silence()
    if quiet is None:
        return None
    if r.process.exiting:  # its program is done: its interpreter's exit is silent (heartbeat.py)
        if quiet > max(heartbeat_timeout, EXIT_GRACE_S):
            return f"did not exit within {quiet:.0f} s of its program's end (stuck in the interpreter's exit)"
    elif quiet > heartbeat_timeout:
        # The host answers but the rank's process does not: stopped, deadlocked or stuck.
        return (f"sent no heartbeat for {quiet:.0f} s (process stopped or hung; "
                f"heartbeat_timeout {heartbeat_timeout:g} s)")
    return None


def _with_likely_cause(reason: str, tail: list[str]) -> str:
    """A rank that died inside gloo (gloo's C++ aborts the process: no Python error says
    why) gets the likely outside cause added to its failure line."""
    if GLOO_HINT in reason:
        return reason
    died_in_gloo = any("gloo" in line.lower() for line in tail) and (
        reason.endswith("status 134") or any("Too many open files" in line for line in tail))
    return f"{reason} ({GLOO_HINT})" if died_in_gloo else reason


def _teardown(ranks: list[_Rank], options: LaunchOptions) -> dict[int, str]:
    """Stop every rank and whatever it started, all hosts at once.

    Returns the ranks that could not be confirmed stopped: rank -> what to tell the user.
    """
    def stop(r: _Rank) -> str | None:
        p = r.process
        if p is None:
            return None
        transport = r.client.get_transport()
        reachable = transport is not None and transport.is_active()
        if reachable and _host_gone(r, options):
            reachable = False
        gone = False
        if reachable:
            if not p.finished:
                p.interrupt()  # Ctrl-C first: lets Python print where it was
                wait_briefly(lambda: p.finished, options.grace)
            try:
                gone = p.stop_group(options.grace)  # the group may outlive its shell
            except Exception:  # noqa: BLE001 - the host went away meanwhile
                gone = False
        p.close()
        return None if gone else _kill_from_new_connection(r, options)

    with ThreadPoolExecutor(max_workers=max(1, len(ranks))) as pool:
        stopped = dict(zip((r.host.rank for r in ranks), pool.map(stop, ranks), strict=True))
    return {rank: msg for rank, msg in stopped.items() if msg is not None}


def _stop_when_back(ranks: list[_Rank], unconfirmed: dict[int, str], options: LaunchOptions,
                    output: RankOutput, seconds: float) -> dict[int, str]:
    """Before a restart: wait up to ``seconds`` for the hosts of ranks that could not be
    stopped (cut off the network) to answer again, and stop those ranks then. A rank
    left running could otherwise hold its GPU or write into the restarted run."""
    names = ", ".join(f"rank {rank} on {ranks[rank].host.name}" for rank in unconfirmed)
    output.note(f"waiting up to {seconds:.0f} s to reach {names} again and stop it", style="bold yellow")
    deadline = time.monotonic() + seconds
    while unconfirmed and time.monotonic() < deadline:
        time.sleep(1.0)
        unconfirmed = {rank: msg for rank in unconfirmed
                       if (msg := _kill_from_new_connection(ranks[rank], options)) is not None}
    return unconfirmed


def _kill_from_new_connection(r: _Rank, options: LaunchOptions) -> str | None:
    """Last resort for a host whose connection died: log in again and kill the group."""
    pgid = r.process.pgid if r.process is not None else None
    if pgid is None:
        return None  # never started: the hang-up of its connection ends it
    try:
        client = connect(r.host, timeout=min(3.0, options.connect_timeout))
        try:
            run(client, sh(shell_line("kill", "-KILL", f"-{pgid}", Shell("2>/dev/null; true"))), timeout=3.0)
        finally:
            client.close()
        return None
    except Exception:  # noqa: BLE001 - reported to the user instead
        return (f"rank {r.host.rank} on {r.host.name} (process group {pgid}) is unreachable; it stops "
                f"when its SSH session times out, or run `kill -KILL -{pgid}` there")


# --------------------------------------------------------------------------- copy back
class Interrupted(BaseException):  # noqa: N818 - a signal, not an error
    """Ctrl-C, SIGTERM or SIGHUP arrived while the hosts were being prepared (connections,
    shipping, uploads) or the run directory copied back.

    Raised by that work itself where it polls (:meth:`_Signal.check`), never by the signal
    handler: an exception from a handler can land inside a lock's acquire or release in
    paramiko and leave it broken. A BaseException, like KeyboardInterrupt, so that it gets
    through libraries' ``except Exception`` blocks.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _copy_back(rank0: _Rank, options: LaunchOptions, output: RankOutput, stop: _Signal) -> LaunchResult:
    """Copy ``<workdir>/runs/<run_id>/`` from rank 0's host to ``<out_dir>/<run_id>/``.

    Written to a fresh hidden folder first and renamed, so a failed copy leaves nothing
    half done; what the host sends is unpacked by :mod:`~meshtrain.hosts.safe_copy`, and
    an entry it refuses (a link, ``..``, over the caps) ends the launch with exit 1. A
    failed or interrupted copy says where the run directory still is and the command that
    fetches it; a signal stops the copy at once (exit 128+N).
    """
    host = rank0.host
    remote = f"{host.workdir}/{REMOTE_RUNS}/{options.run_id}"
    final = options.out_dir / options.run_id
    use_sftp = False  # the tar command in messages works whether or not the host has sftp
    try:
        stop.check()
        if not remote_dir_exists(rank0.client, remote):
            return LaunchResult(0, [], None, 0.0)  # a script that wrote no run directory
        ours = only_control(final)  # --elastic: the launcher's control folder is all it holds
        if final.exists() and not ours:
            output.note(f"{final} already exists; not overwriting it with {host.name}:{remote}",
                        style="bold yellow")
            return LaunchResult(0, [], final, 0.0)
        use_sftp = not has_tar(rank0.client)
        if use_sftp and not has_sftp(rank0.client):
            raise TransferError(f"{host.name} has neither tar nor an sftp server")
        stop.check()
        output.note(f"copying {host.name}:{sftp_path(remote)} to {final}")
        options.out_dir.mkdir(parents=True, exist_ok=True)
        into = options.out_dir / f".{options.run_id}.copying" if ours else final
        fetch_tree(rank0.client, remote, into, use_sftp=use_sftp, limits=options.copy_limits,
                   check_stop=stop.check)
        if ours:
            keep_control(final, into)
    except Interrupted as exc:
        output.note(f"{signal.Signals(exc.signum).name} received during the copy-back; "
                    + _still_there(host, remote, options.out_dir, use_sftp), style="bold yellow")
        return LaunchResult(128 + exc.signum, [], None, 0.0)
    except UnsafeRunDirectory as exc:  # nothing to fetch by hand: a plain `tar -x` of it is what this refuses
        output.note(f"{host.name} sent an unsafe run directory: {exc}", style="bold red")
        return LaunchResult(1, [], None, 0.0, copy_failed=True)
    except (OSError, EOFError, paramiko.SSHException, TransferError) as exc:
        # A full local disk is an OSError without a file name: no "(None)" after its reason.
        reason = (exc.strerror + (f" ({exc.filename})" if exc.filename else "")
                  if isinstance(exc, OSError) and exc.strerror else exc)
        output.note(f"could not copy the run directory to {final}: {reason or type(exc).__name__}; "
                    + _still_there(host, remote, options.out_dir, use_sftp), style="bold red")
        return LaunchResult(1, [], None, 0.0, copy_failed=True)
    output.note(f"run directory copied to {final}")
    return LaunchResult(0, [], final, 0.0)


def _report_incomplete(rank0: _Rank, options: LaunchOptions, output: RankOutput) -> None:
    """After a failure: say so if rank 0 kept a part-written run directory (a full disk at
    the end keeps what was written, model.pt included, as ``<run_id>.incomplete``)."""
    remote = f"{rank0.host.workdir}/{REMOTE_RUNS}/{options.run_id}.incomplete"
    if _host_gone(rank0, options):
        return  # rank 0's host is gone: asking it would only wait
    try:
        kept = remote_dir_exists(rank0.client, remote)
    except Exception:  # noqa: BLE001 - rank 0's host is gone: nothing more to say
        return
    if kept:
        output.note("rank 0 kept what it wrote in an incomplete run directory; "
                    + _still_there(rank0.host, remote, options.out_dir, use_sftp=False), style="bold")


def _still_there(host: Host, remote: str, out_dir: Path, use_sftp: bool) -> str:
    """Where the run directory still is, and the command that fetches it into ``out_dir``."""
    path = sftp_path(remote)  # scp and ssh start at the home folder, like SFTP
    key = ["-i", host.identity_file] if host.identity_file else []
    target = f"{host.user}@{host.hostname}"
    if use_sftp:
        fetch = shell_line("scp", "-r", "-P", str(host.port), *key, f"{target}:{path}", f"{out_dir}/")
    else:  # what the launcher does, and it works where sftp is off (scp now speaks SFTP)
        local = str(out_dir / Path(path).name)
        fetch = shell_line("mkdir", "-p", local, Shell("&&"), "ssh", "-p", str(host.port), *key, target,
                           shell_line("tar", "-C", path, "-cf", "-", "."), Shell("|"), "tar", "-C", local,
                           "-xf", "-")
    return f"the run directory is still on {host.name}: {path} (fetch it with: {fetch})"


# --------------------------------------------------------------------------- signals
class _Signal:
    """The first stopping signal received; the launch loop and the copy-back poll it."""

    signum: int | None = None

    def check(self) -> None:
        """Raise :class:`Interrupted` if a signal has arrived (the poll of long steps)."""
        if self.signum is not None:
            raise Interrupted(self.signum)


@contextmanager
def _stop_on_signals() -> Iterator[_Signal]:
    """Turn SIGINT, SIGTERM and SIGHUP into a flag the launch loop checks, then restore.

    The handler only records the signal: whatever the main thread is doing when it runs
    (inside paramiko's locks, rich's console) goes on undisturbed until it next polls.
    """
    flag = _Signal()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    def handler(signum: int, frame: object) -> None:
        if flag.signum is None:
            flag.signum = signum
    wanted = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    previous = {s: signal.signal(s, handler) for s in wanted}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
