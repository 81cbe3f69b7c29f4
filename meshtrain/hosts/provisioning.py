"""``meshtrain hosts setup``: give every host of an inventory this machine's meshtrain.

Per host, over the SSH connection the launcher uses (same host-key checks): find a
base ``python3`` that meshtrain supports, make (or reuse) a virtual environment at
``<workdir>/.venv``, ``pip install`` the exact versions of meshtrain's dependencies
installed here (torch, transformers, peft, ...: the host needs access to a package
index, or ``--pip-arg`` pointing at one), then ship this meshtrain as a wheel (SFTP,
or ``cat`` over SSH without it) and install it without dependencies. pip compiles no
bytecode; importing what a rank imports then compiles just that (see COMPILE_IMPORTS).

What was installed is recorded in ``<workdir>/.venv/meshtrain-setup.json``. The next
run asks each host one short question (that manifest and the installed versions) and,
when everything matches, installs nothing: "up to date".

Hosts sharing a machine and workdir share one environment: it is set up once.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import paramiko
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from meshtrain.errors import RunFailure
from meshtrain.hosts.host_output import host_json, visible
from meshtrain.hosts.inventory import Host, Inventory
from meshtrain.hosts.local_install import LocalInstall, public_version
from meshtrain.hosts.ssh import (
    ANSWER_LIMIT,
    HostPath,
    OutputTooLarge,
    Result,
    Shell,
    SSHError,
    connect,
    run,
    sh,
    shell_line,
)
from meshtrain.hosts.transfer import TransferError, has_sftp, put_files

VENV = ".venv"
MANIFEST = "meshtrain-setup.json"
WHEELS = "meshtrain-wheels"  # inside the venv: the shipped wheel, kept for the record
INSTALLED, UP_TO_DATE, FAILED = "installed", "up to date", "failed"
QUESTION_TIMEOUT = 60.0
COMMAND_MAX_BYTES = 16 << 20  # what pip and setup's own steps print (pip runs with -q)
PYTHON_VERSION = re.compile(r"[0-9]+\.[0-9]+\.[0-9]+[0-9a-z+]{0,16}")  # 3.11.7, 3.14.0rc1
# Seconds pip may go without printing (a slow download of torch on a slow link).
PIP_STALL_TIMEOUT = 1800.0

# Run by the venv's interpreter: its Python version, the manifest and installed versions.
STATUS = r"""
import json, os, sys, importlib.metadata as md
out = {"python": sys.version.split()[0], "manifest": None, "installed": {}}
try:
    with open(os.path.expanduser(sys.argv[1])) as f:
        out["manifest"] = json.load(f)
except Exception:
    pass
for name in sys.argv[2:]:
    try:
        out["installed"][name] = md.version(name)
    except Exception:
        out["installed"][name] = None
print(json.dumps(out))
"""

# Run by the base interpreter: its version, and whether it can make a venv with pip.
BASE_PROBE = r"""
import json, sys
try:
    import ensurepip, venv
    ok = True
except Exception:
    ok = False
print(json.dumps({"python": "%d.%d.%d" % sys.version_info[:3], "venv": ok}))
"""

# Run by the venv's interpreter after the install: import what a rank imports, which writes
# their bytecode. pip installs with --no-compile: compiling every file of torch and
# transformers took 55 of the 99 s of this machine's install (2 cores), and a rank imports
# about a quarter of them. sys.dont_write_bytecode: written even where the host's shell sets
# PYTHONDONTWRITEBYTECODE, or every rank's start would compile them again. An import that
# fails fails the setup, with its last line.
COMPILE_IMPORTS = r"""
import sys
sys.dont_write_bytecode = False
import meshtrain.cli.main, torch._dynamo, matplotlib.backends.backend_agg
from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration, WhisperTokenizer
import jiwer, peft
"""

# Run by the venv's interpreter: write the manifest (read from stdin) atomically.
WRITE_MANIFEST = r"""
import os, sys
path = os.path.expanduser(sys.argv[1])
with open(path + ".tmp", "w") as f:
    f.write(sys.stdin.read())
    f.flush()
    os.fsync(f.fileno())
os.replace(path + ".tmp", path)
"""


class SetupFailed(RunFailure):
    """One host could not be set up; the message is one line with the reason (what the host
    said is quoted with its control characters written out)."""

    def __init__(self, message: str) -> None:
        super().__init__(visible(message))


@dataclass(frozen=True)
class SetupOptions:
    """How ``hosts setup`` installs."""

    base_python: str = "python3"  # interpreter on the host that makes the venv (name or path)
    pip_args: tuple[str, ...] = ()  # extra pip arguments, e.g. ("--index-url", "https://...")
    accept_new_host_keys: bool = False
    timeout: float = 10.0  # seconds to connect


@dataclass
class HostSetup:
    """The outcome for one host."""

    host: Host
    status: str = FAILED  # INSTALLED, UP_TO_DATE or FAILED
    python: str | None = None  # the venv's interpreter, as the inventory's ``python`` should say
    detail: str = ""  # what was done, or why it failed (one line)
    seconds: float = 0.0
    shared_with: str | None = None  # set up together with this host (same machine and workdir)


def venv_python(host: Host) -> str:
    """``<workdir>/.venv/bin/python``: the interpreter ``hosts setup`` makes on ``host``."""
    return f"{host.workdir.rstrip('/')}/{VENV}/bin/python"


def manifest(local: LocalInstall, python: str) -> dict[str, object]:
    """What a host's environment records after a successful setup."""
    return {"meshtrain": local.version, "wheel": local.wheel.name, "wheel_digest": local.digest,
            "pins": list(local.pins), "python": python}


def up_to_date(status: dict[str, object], local: LocalInstall) -> str | None:
    """None when the host's environment holds exactly ``local``; otherwise what differs."""
    recorded = status.get("manifest")
    if not isinstance(recorded, dict):
        return "no manifest"
    installed = status.get("installed")
    installed = installed if isinstance(installed, dict) else {}
    if recorded.get("wheel_digest") != local.digest:
        return "meshtrain differs"
    if installed.get("meshtrain") != local.version:
        return f"meshtrain {installed.get('meshtrain')} installed"
    if recorded.get("pins") != list(local.pins):
        return "pinned versions differ"
    for pin in local.pins:
        name, version = pin.split("==")
        have = installed.get(name)
        if have is None or public_version(str(have)) != version:
            return f"{name} {have} installed, {version} wanted"
    return None


def provision_hosts(inventory: Inventory, local: LocalInstall, options: SetupOptions,
                    on_stage: Callable[[Host, str], None] = lambda host, stage: None) -> list[HostSetup]:
    """Set up every host (in parallel), one result per host in rank order.

    ``on_stage(host, text)`` is called as each host moves on ("creating venv", ...).
    Hosts with the same machine, user and workdir are set up once, by the first of them.
    Ctrl-C closes every connection at once, which ends what runs on the hosts.
    """
    results = [HostSetup(h) for h in inventory.hosts]
    first: dict[tuple[str, int, str, str], HostSetup] = {}
    for r in results:
        key = (r.host.hostname, r.host.port, r.host.user, r.host.workdir)
        if key in first:
            r.shared_with = first[key].host.name
        else:
            first[key] = r
    leaders = list(first.values())
    opened: list[paramiko.SSHClient] = []  # every connection made, closed at once on Ctrl-C

    def one(result: HostSetup) -> None:
        started = time.monotonic()
        try:
            result.status, result.detail = _provision(result.host, local, options,
                                                      lambda text: on_stage(result.host, text), opened)
            result.python = venv_python(result.host)
        except SetupFailed as exc:
            result.status, result.detail = FAILED, str(exc)
        except SSHError as exc:
            result.status, result.detail = FAILED, str(exc).split(": ", 1)[1]
        except (OSError, EOFError, paramiko.SSHException, TransferError) as exc:
            result.status, result.detail = FAILED, f"connection failed: {exc or type(exc).__name__}"
        result.seconds = time.monotonic() - started
        on_stage(result.host, result.status)

    pool = ThreadPoolExecutor(max_workers=min(16, len(leaders)))
    try:
        list(pool.map(one, leaders))
    except BaseException:  # Ctrl-C: end every host's step now (its pty hangs up), not after pip
        for client in opened:
            client.close()
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    for r in results:
        if r.shared_with is not None:
            leader = next(x for x in leaders if x.host.name == r.shared_with)
            r.status, r.python, r.seconds = leader.status, leader.python and venv_python(r.host), 0.0
            r.detail = f"same machine and workdir as {leader.host.name}: {leader.detail}"
            on_stage(r.host, r.status)
    return results


def _provision(host: Host, local: LocalInstall, options: SetupOptions,
               stage: Callable[[str], None], opened: list[paramiko.SSHClient]) -> tuple[str, str]:
    stage("connecting")
    client = connect(host, accept_new_host_keys=options.accept_new_host_keys, timeout=options.timeout)
    opened.append(client)
    try:
        stage("checking the environment")
        state, status = _status(client, host, local)
        if state == "ok":
            reason = up_to_date(status, local)
            if reason is None:
                return UP_TO_DATE, f"meshtrain {local.version}, python {status['python']}"
        python = _check_base_python(client, host, local, options.base_python, stage) \
            if state != "ok" else str(status["python"])
        if state != "ok":
            stage("creating venv")
            clear = ["--clear"] if state == "broken" else []
            _must(client, shell_line(_program(options.base_python), "-m", "venv", *clear,
                                     HostPath(_venv(host))),
                  f"creating {_venv(host)} with {options.base_python}")
        py = HostPath(venv_python(host))
        pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--progress-bar",
               "off", "-q", "--no-compile", *options.pip_args]
        names = [p.split("==")[0] for p in local.pins]
        shown = ", ".join(p.replace("==", " ") for p in local.pins[:3])
        more = f" + {len(local.pins) - 3} more" if len(local.pins) > 3 else ""
        stage(f"installing {shown}{more}")
        _must(client, shell_line(*pip, *local.pins),
              f"pip install of {', '.join(names)}", timeout=PIP_STALL_TIMEOUT)
        stage(f"shipping meshtrain {local.version} (wheel)")
        folder = f"{_venv(host)}/{WHEELS}"
        _must(client, shell_line("rm", "-rf", HostPath(folder), Shell("&&"), "mkdir", "-p", HostPath(folder)),
              f"creating {folder}")
        put_files(client, folder, [local.wheel], use_sftp=has_sftp(client))
        stage(f"installing meshtrain {local.version}")
        _must(client, shell_line(*pip, "--no-deps", "--force-reinstall",
                                 HostPath(folder + "/" + local.wheel.name)),
              "pip install of the meshtrain wheel", timeout=PIP_STALL_TIMEOUT)
        stage("compiling the modules a rank imports")
        _must(client, shell_line(py, "-c", COMPILE_IMPORTS), "importing meshtrain and its dependencies",
              timeout=PIP_STALL_TIMEOUT)
        stage("recording what was installed")
        text = json.dumps(manifest(local, python), indent=2) + "\n"
        _must(client, shell_line(py, "-c", WRITE_MANIFEST, HostPath(_venv(host) + "/" + MANIFEST)),
              "writing the manifest", stdin=text.encode())
        state, status = _status(client, host, local)
        reason = up_to_date(status, local) if state == "ok" else "the venv's python does not run"
        if reason is not None:
            raise SetupFailed(f"installed, but the environment does not match: {reason}")
        return INSTALLED, f"meshtrain {local.version} ({local.source}) and {len(local.pins)} packages, " \
                          f"python {python}"
    finally:
        client.close()


def _venv(host: Host) -> str:
    return f"{host.workdir.rstrip('/')}/{VENV}"


def _program(program: str) -> str:
    """A base interpreter: a path (``~`` expanded) or a bare name looked up in PATH."""
    return HostPath(program) if program.startswith(("/", "~")) else program


def _status(client: paramiko.SSHClient, host: Host, local: LocalInstall) -> tuple[str, dict[str, object]]:
    """("missing" | "broken" | "ok", what the venv's interpreter reports)."""
    venv, py = HostPath(_venv(host)), HostPath(venv_python(host))
    names = ["meshtrain", *(p.split("==")[0] for p in local.pins)]
    script = shell_line(Shell("if ["), "-x", py, Shell("]; then exec"), py, "-c", STATUS,
                        HostPath(_venv(host) + "/" + MANIFEST), *names,
                        Shell("; elif ["), "-e", venv, Shell("]; then exit 43; else exit 42; fi"))
    result = _ask(client, script, f"{_venv(host)}'s status")
    if result.status == 42:
        return "missing", {}
    try:  # the host's answer is checked before it is used
        status = host_json(result.stdout.strip().splitlines()[-1])
        if not (isinstance(status.get("python"), str) and PYTHON_VERSION.fullmatch(status["python"])):
            raise ValueError("no 'python' version")
    except (ValueError, IndexError):
        return "broken", {}  # 43, or an interpreter that no longer runs (its base python went away)
    return "ok", status


def _ask(client: paramiko.SSHClient, script: str, what: str) -> Result:
    """Run a probe on the host; its output is bounded (a host may answer anything)."""
    try:
        return run(client, sh(script), timeout=QUESTION_TIMEOUT)  # at most ANSWER_LIMIT bytes
    except OutputTooLarge:
        raise SetupFailed(f"{what}: the host answered with more than {ANSWER_LIMIT} bytes") from None


def _check_base_python(client: paramiko.SSHClient, host: Host, local: LocalInstall, base: str,
                       stage: Callable[[str], None]) -> str:
    stage(f"checking {base}")
    result = _ask(client, shell_line("command", "-v", _program(base), Shell(">/dev/null 2>&1 || exit 41;"),
                                     "exec", _program(base), "-c", BASE_PROBE), f"--base-python {base}")
    if result.status == 41:
        raise SetupFailed(f"--base-python {base}: not found on the host (give its absolute path, "
                          "e.g. /opt/homebrew/bin/python3)")
    try:  # the host's answer is checked before it is used
        info = host_json(result.stdout.strip().splitlines()[-1])
        version = info.get("python")
        if not (isinstance(version, str) and PYTHON_VERSION.fullmatch(version)) \
                or not isinstance(info.get("venv"), bool):
            raise ValueError("not the probe's answer")
    except (ValueError, IndexError):
        raise SetupFailed(f"--base-python {base} does not run: {_last_line(result.stderr)}") from None
    try:
        supported = SpecifierSet(local.requires_python).contains(version)
    except InvalidSpecifier:
        supported = True
    if not supported:
        raise SetupFailed(f"--base-python {base} is Python {version}; meshtrain needs Python "
                          f"{local.requires_python}: install a newer python3 there and pass its path")
    if not info["venv"]:
        raise SetupFailed(f"--base-python {base} (Python {version}) cannot make a virtual environment "
                          "(no venv/ensurepip; Debian: apt-get install python3-venv)")
    return version


def _must(client: paramiko.SSHClient, command: str, what: str, *, timeout: float = QUESTION_TIMEOUT,
          stdin: bytes | None = None) -> None:
    try:
        # A step without input ends with its connection (Ctrl-C here): a pip install left
        # running would race the next setup's in the same venv.
        result = run(client, sh(command), timeout=timeout, stdin=stdin, max_output=COMMAND_MAX_BYTES,
                     hang_up=stdin is None)
    except OutputTooLarge:
        raise SetupFailed(f"{what}: the host printed more than {COMMAND_MAX_BYTES} bytes") from None
    if result.status != 0:
        raise SetupFailed(f"{what} failed: {_last_line(result.stderr or result.stdout)}")


def _last_line(text: str) -> str:
    """pip's last ERROR line (not its warnings), else the last line of output; control
    characters made visible (the host's output reaches this terminal)."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("ERROR:")]
    return visible((errors or lines or ["no output"])[-1])

