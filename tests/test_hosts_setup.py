"""`meshtrain hosts setup` for real: a clean host (a fresh workdir, no venv, no meshtrain)
gets a venv with this meshtrain and the pinned torch/transformers/peft, then `hosts check`
passes and a launch trains with the new interpreter; a second run changes nothing.

The hosts are the loopback sshd in the root namespace, not network namespaces: pip on
the host needs a package index (here the machine's configured index and find-links), and
the namespaces have no route to any index, so an install there could only fail.
The real install (pip, from pip's cache) takes about two minutes on 2 cores: it is done
once for the module and shared by the tests that need it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from in_process import meshtrain_here
from ssh_fixtures import SshWorld, free_port

from meshtrain.hosts.inventory import load_inventory
from meshtrain.hosts.inventory_edit import set_python
from meshtrain.hosts.local_install import dependency_pins, installed_distribution, wheel_digest

pytestmark = pytest.mark.slow

BASE_PYTHON = "/usr/bin/python3"  # the host's system python: no meshtrain, no torch
INVENTORY = """\
# two ranks on one machine (they share the workdir, so one environment)
defaults:
  user: root
  identity_file: {key}
  known_hosts: {known}
  ssh_config: {ssh_config}
  python: {python}   # the system python: nothing installed yet
  workdir: {workdir}
  device: cpu
rendezvous: {{port: {rendezvous}, timeout: 60}}
hosts:
  - {{name: alpha, host: 127.0.0.1, port: {port}}}   # rank 0
  - name: beta
    host: 127.0.0.1
    port: {port}
"""


@pytest.fixture(scope="module", name="loopback_ssh")
def clean_host_ssh(loopback_ssh: SshWorld) -> SshWorld:
    """The session's loopback sshd, where the host's base interpreter exists."""
    if not Path(BASE_PYTHON).is_file():
        pytest.skip(f"{BASE_PYTHON} (the clean host's base interpreter) is not installed")
    return loopback_ssh


def write_inventory(world: SshWorld, folder: Path, workdir: Path, python: str = BASE_PYTHON) -> Path:
    path = folder / "inv.yaml"
    path.write_text(INVENTORY.format(key=world.user_key, known=world.known_hosts,
                                     ssh_config=world.folder / "ssh_config", python=python,
                                     workdir=workdir, rendezvous=free_port(), port=world.servers[0].port))
    return path


@dataclass
class Installed:
    folder: Path
    inventory: Path
    workdir: Path
    first: object  # the CompletedProcess of the first run
    inventory_before: str
    seconds: float
    check_before: object
    wheel: Path  # a copy of the wheel the first run shipped


@pytest.fixture(scope="module")
def installed(loopback_ssh: SshWorld, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    folder = tmp_path_factory.mktemp("setup")
    workdir = folder / "host-workdir"
    inventory = write_inventory(loopback_ssh, folder, workdir)
    before = inventory.read_text()
    check_before = meshtrain_here("hosts", "check", str(inventory), cwd=folder)
    started = time.monotonic()
    first = meshtrain_here("hosts", "setup", str(inventory), cwd=folder, timeout=900)
    seconds = time.monotonic() - started
    print(f"first hosts setup (clean host, real pip install): {seconds:.1f} s")
    # Later runs ship this very wheel (--wheel): a checkout edited meanwhile is another
    # meshtrain, which setup rightly installs again.
    shipped = list((workdir / ".venv" / "meshtrain-wheels").glob("*.whl"))
    wheel = folder / "wheel" / shipped[0].name if shipped else folder / "missing.whl"
    if shipped:
        wheel.parent.mkdir()
        shutil.copy2(shipped[0], wheel)
    yield Installed(folder, inventory, workdir, first, before, seconds, check_before, wheel)
    # 1.2 GB of venv (~60,000 files): not left in pytest's kept folders. Removed by an `rm` in the
    # background, not waited for: on a disk busy with the rest of the suite, removing it took this
    # worker 4 to 60 s. (sh returns at once; the rm it leaves behind ends by itself.)
    subprocess.run(["sh", "-c", 'rm -rf -- "$1" >/dev/null 2>&1 </dev/null &', "sh", str(workdir)],
                   check=True, timeout=30)


def test_clean_host_is_set_up_then_checks_and_trains(loopback_ssh: SshWorld, installed: Installed) -> None:
    # Before: the host's system python has no meshtrain, so `hosts check` failed.
    assert installed.check_before.returncode == 1
    assert ("alpha: meshtrain: meshtrain does not import with /usr/bin/python3"
            in installed.check_before.stderr)
    result = installed.first
    assert result.returncode == 0, result.stdout + result.stderr
    assert "alpha: installed in" in result.stdout
    assert "beta: installed: same machine and workdir as alpha" in result.stdout
    venv_python = installed.workdir / ".venv" / "bin" / "python"
    assert venv_python.is_file()
    # pip compiled nothing (--no-compile); setup then imported what a rank imports, which wrote
    # their bytecode, and only theirs.
    site = next((installed.workdir / ".venv" / "lib").glob("python3*/site-packages"))
    for module in ("torch/__init__", "torch/_dynamo/__init__", "meshtrain/cli/main",
                   "transformers/models/whisper/modeling_whisper", "peft/__init__"):
        folder, name = module.rsplit("/", 1)
        assert list((site / folder / "__pycache__").glob(f"{name}.*.pyc")), module
    assert not (site / "transformers/models/bert/__pycache__").exists()

    # The inventory's python now points at the new environment; comments and layout kept.
    expected = installed.inventory_before.replace(f"python: {BASE_PYTHON}", f"python: {venv_python}")
    assert installed.inventory.read_text() == expected
    assert {h.python for h in load_inventory(installed.inventory).hosts} == {str(venv_python)}

    # The manifest records exactly this machine's meshtrain wheel and pins.
    manifest = json.loads((installed.workdir / ".venv" / "meshtrain-setup.json").read_text())
    assert manifest["pins"] == list(dependency_pins())
    assert manifest["meshtrain"] == installed_distribution().version
    shipped = next((installed.workdir / ".venv" / "meshtrain-wheels").glob("*.whl"))
    assert manifest["wheel_digest"] == wheel_digest(shipped)
    # The built-in profiles are package data: in the wheel, so on every host set up.
    with zipfile.ZipFile(shipped) as wheel:
        assert {"meshtrain/profiles/whisper-tiny-lora.yaml", "meshtrain/profiles/whisper-small-diloco.yaml",
                "meshtrain/profiles/whisper-tiny-random-lora.yaml"} <= set(wheel.namelist())

    check = meshtrain_here("hosts", "check", str(installed.inventory), cwd=installed.folder)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "all 2 hosts ready" in check.stdout

    # A rendezvous port of its own: `hosts check` listened on the inventory's a moment ago.
    launch_inventory = installed.folder / "launch.yaml"
    launch_inventory.write_text(re.sub(r"rendezvous: \{port: \d+", f"rendezvous: {{port: {free_port()}",
                                       installed.inventory.read_text()))
    launched = meshtrain_here("launch", str(launch_inventory), "--task", "digits", "--steps", "5",
                              "--threads", "1", "--plain", "--run-id", "after-setup",
                              "--out", str(installed.folder / "runs"), cwd=installed.folder, timeout=300)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    summary = json.loads((installed.folder / "runs" / "after-setup" / "summary.json").read_text())
    assert summary["nodes"] == 2 and summary["steps"] == 5
    # The ranks ran the venv's interpreter, which recorded itself in the run's provenance.
    config = yaml.safe_load((installed.folder / "runs" / "after-setup" / "config.yaml").read_text())
    assert str(installed.workdir / ".venv") in json.dumps(config)

    # A rank on the set-up host (no checkout, no profiles/ in its workdir) resolves a built-in
    # profile by name from its installed meshtrain.
    lookup = ("from meshtrain.config.profiles import find_profile as f, load_profile as p; "
              "print('profile', f('whisper-tiny-lora'), p('whisper-tiny-lora')['task'])")
    resolved = meshtrain_here("launch", str(launch_inventory), "--plain",
                              "--out", str(installed.folder / "runs"), "--", "python", "-c", lookup,
                              cwd=installed.folder, timeout=120)
    assert resolved.returncode == 0, resolved.stdout + resolved.stderr
    site = installed.workdir / ".venv" / "lib"
    assert resolved.stdout.count(f"profile {site}") == 2, resolved.stdout  # both ranks
    assert "meshtrain/profiles/whisper-tiny-lora.yaml whisper" in resolved.stdout
    assert not (installed.workdir / "profiles").exists()


def test_second_run_is_up_to_date_and_changes_nothing(loopback_ssh: SshWorld, installed: Installed) -> None:
    assert installed.first.returncode == 0, installed.first.stdout + installed.first.stderr
    venv = installed.workdir / ".venv"
    manifest = venv / "meshtrain-setup.json"
    stamps = {p: p.stat().st_mtime_ns for p in (installed.inventory, manifest, venv / "bin" / "python")}
    text = installed.inventory.read_text()
    started = time.monotonic()
    again = meshtrain_here("hosts", "setup", str(installed.inventory),
                           "--wheel", str(installed.wheel), cwd=installed.folder)
    seconds = time.monotonic() - started
    print(f"second hosts setup (up to date): {seconds:.1f} s")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "alpha: up to date" in again.stdout
    assert "everything up to date, nothing changed" in again.stdout
    assert installed.inventory.read_text() == text
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert seconds < 60  # generous: measured ~4 s here


def test_a_changed_package_is_noticed_and_reinstalled(loopback_ssh: SshWorld, installed: Installed) -> None:
    """Someone replaced meshtrain in the host's venv: the next setup puts this one back."""
    assert installed.first.returncode == 0, installed.first.stdout + installed.first.stderr
    manifest = installed.workdir / ".venv" / "meshtrain-setup.json"
    recorded = json.loads(manifest.read_text())
    recorded["wheel_digest"] = "0" * 64  # as if another meshtrain had been installed
    manifest.write_text(json.dumps(recorded))
    result = meshtrain_here("hosts", "setup", str(installed.inventory),
                            "--wheel", str(installed.wheel), cwd=installed.folder, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "alpha: installed in" in result.stdout
    assert json.loads(manifest.read_text())["wheel_digest"] == wheel_digest(installed.wheel)


def test_bad_base_python_is_one_line_and_other_hosts_continue(loopback_ssh: SshWorld, installed: Installed,
                                                             tmp_path: Path) -> None:
    assert installed.first.returncode == 0, installed.first.stdout + installed.first.stderr
    inventory = write_inventory(loopback_ssh, tmp_path, installed.workdir,
                                python=str(installed.workdir / ".venv" / "bin" / "python"))
    # beta: a clean workdir of its own, where the missing base python matters.
    text = inventory.read_text().replace("    port:", f"    workdir: {tmp_path / 'clean'}\n    port:")
    inventory.write_text(text)
    before = inventory.read_text()
    result = meshtrain_here("hosts", "setup", str(inventory), "--wheel", str(installed.wheel),
                            "--base-python", "/nonexistent/python3", cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    failures = [x for x in result.stderr.splitlines() if x.startswith("failed:")]
    assert failures == [f"failed: beta (root@127.0.0.1:{loopback_ssh.servers[0].port}): --base-python "
                        "/nonexistent/python3: not found on the host (give its absolute path, e.g. "
                        "/opt/homebrew/bin/python3)"]
    assert "alpha: up to date" in result.stdout  # the other host went on
    assert "Traceback" not in result.stderr
    assert inventory.read_text() == before  # nothing written while a host failed
    assert not (tmp_path / "clean" / ".venv").exists()


def test_pip_failure_is_one_line(loopback_ssh: SshWorld, installed: Installed, tmp_path: Path) -> None:
    """No index and no find-links (--pip-arg, --isolated drops the user's pip config): pip's own
    last error, on one line. (The module's wheel is shipped, not built again: pip fails before
    any wheel is shipped.)"""
    assert installed.wheel.is_file(), installed.first.stdout + installed.first.stderr
    inventory = write_inventory(loopback_ssh, tmp_path, tmp_path / "workdir")
    result = meshtrain_here("hosts", "setup", str(inventory), "--pip-arg=--no-index", "--pip-arg=--isolated",
                            "--wheel", str(installed.wheel), "--base-python", BASE_PYTHON, cwd=tmp_path,
                            timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    failure, shared = [x for x in result.stderr.splitlines() if x.startswith("failed:")]
    assert failure.startswith("failed: alpha (root@127.0.0.1:")
    assert "pip install of torch, " in failure and "ERROR: " in failure
    assert shared.startswith("failed: beta (") and "same machine and workdir as alpha" in shared
    assert "not changed" in result.stderr


def test_inventory_edit_keeps_comments_and_says_what_it_cannot_do(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text("# lab\ndefaults:\n  python: /usr/bin/python3  # old\n  workdir: ~/w\nhosts:\n"
                    "  - {name: a, host: h1}   # rank 0\n  - name: b\n    host: h2\n    python: '/opt/py'\n")
    os.chmod(path, 0o640)  # not what the umask gives a new file: kept by the edit
    edit = set_python(path, {"a": "~/w/.venv/bin/python", "b": "~/w/.venv/bin/python"})
    assert edit.written and edit.changed == ["a", "b"]
    assert path.read_text() == ("# lab\ndefaults:\n  python: ~/w/.venv/bin/python  # old\n  workdir: ~/w\n"
                                "hosts:\n  - {name: a, host: h1}   # rank 0\n  - name: b\n    host: h2\n"
                                "    python: '~/w/.venv/bin/python'\n")
    assert path.stat().st_mode & 0o777 == 0o640
    assert not set_python(path, {"a": "~/w/.venv/bin/python", "b": "~/w/.venv/bin/python"}).changed

    # Two hosts inheriting the defaults but wanting different interpreters: a key to add, by hand.
    path.write_text("defaults: {python: /usr/bin/python3}\nhosts:\n  - {name: a, host: h1}\n"
                    "  - {name: b, host: h2}\n")
    text = path.read_text()
    edit = set_python(path, {"a": "/x/.venv/bin/python", "b": "/y/.venv/bin/python"})
    assert not edit.written and path.read_text() == text
    assert edit.by_hand == ["host a: set python: /x/.venv/bin/python",
                            "host b: set python: /y/.venv/bin/python"]

    edit = set_python(path, {"a": "/x/bin/python", "b": "/x/bin/python"}, write=False)
    assert not edit.written and edit.by_hand == ["defaults: set python: /x/bin/python"]
    assert path.read_text() == text


def test_a_wheel_of_another_version_is_refused_before_connecting(tmp_path: Path) -> None:
    inventory = tmp_path / "inv.yaml"
    inventory.write_text("defaults: {python: /usr/bin/python3, known_hosts: /nonexistent}\n"
                         "hosts:\n  - {name: a, host: 192.0.2.1}\n")
    wheel = tmp_path / "meshtrain-9.9.9-py3-none-any.whl"
    wheel.write_bytes(b"")
    result = meshtrain_here("hosts", "setup", str(inventory), "--wheel", str(wheel), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert f"--wheel {wheel}: not a wheel of meshtrain" in result.stderr
