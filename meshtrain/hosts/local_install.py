"""What this machine has installed, as ``hosts setup`` reproduces it on a host.

Two things: a wheel of exactly the meshtrain that runs here, and the exact versions of
meshtrain's dependencies installed here (torch, transformers, peft, ...), as pins.

The wheel comes from where this meshtrain was installed from (``direct_url.json``):
an editable checkout is built into a wheel (from a copy of its sources, so the
checkout gets no ``build/`` or ``*.egg-info`` folders); a local wheel file that still
exists is used as it is; anything else is packed back into a wheel from the files
pip recorded as installed. Its *digest* hashes the wheel's contents, not its zip
bytes, so two builds of the same sources (different file times) count as equal.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as metadata
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from meshtrain.errors import RunFailure

PACKAGE = "meshtrain"
# Files of a checkout that a wheel build reads besides the package itself.
PROJECT_FILES = ("pyproject.toml", "setup.py", "setup.cfg", "MANIFEST.in")
# Written by the installer into an installed dist-info; no part of a wheel.
INSTALLER_FILES = ("INSTALLER", "REQUESTED", "direct_url.json", "RECORD")
BUILD_TIMEOUT = 300.0


class LocalInstallError(RunFailure):
    """This machine's meshtrain cannot be packed into a wheel; one line says why."""


@dataclass(frozen=True)
class LocalInstall:
    """The wheel and pins that make a host's environment match this one."""

    version: str  # meshtrain's version
    wheel: Path  # a wheel file of this meshtrain
    digest: str  # sha256 over the wheel's member names and contents
    pins: tuple[str, ...]  # "torch==2.13.0", one per installed dependency
    requires_python: str  # meshtrain's Requires-Python, e.g. ">=3.10"
    source: str  # where the wheel came from, for messages ("wheel", "checkout", ...)


def dependency_pins(package: str = PACKAGE) -> tuple[str, ...]:
    """``name==version`` for every dependency of ``package`` installed here (extras left out).

    The local version label is dropped (``2.13.0+cpu`` pins ``2.13.0``): the host's own
    pip then picks the build for its platform (the normal build on a Mac, the CPU wheel
    where a find-links folder offers one), and PEP 440 counts ``2.13.0+cpu`` as ``2.13.0``.
    """
    pins: list[str] = []
    for requirement in installed_distribution(package).requires or []:
        name_match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
        marker = requirement.split(";", 1)[1] if ";" in requirement else ""
        if name_match is None or "extra" in marker:
            continue
        try:
            dist = metadata.distribution(name_match.group(1))
        except metadata.PackageNotFoundError:
            continue  # a dependency whose marker excludes this machine
        pins.append(f"{dist.metadata['Name']}=={public_version(dist.version)}")
    return tuple(pins)


def public_version(version: str) -> str:
    """The version without its local label: ``2.13.0+cpu`` -> ``2.13.0``."""
    return version.split("+", 1)[0]


def local_install(workdir: Path, wheel: Path | None = None) -> LocalInstall:
    """Find or build this meshtrain's wheel in ``workdir`` and collect the pins; ``wheel``,
    if given, is used instead (it must be this meshtrain version)."""
    dist = installed_distribution()
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    url = direct.get("url", "")
    path = Path(unquote(urlparse(url).path)) if url.startswith("file://") else None
    if wheel is not None:
        prefix = f"{PACKAGE}-{dist.version}-"
        if not wheel.is_file() or wheel.suffix != ".whl":
            raise LocalInstallError(f"--wheel {wheel}: no such wheel file")
        if not wheel.name.startswith(prefix):
            raise LocalInstallError(f"--wheel {wheel}: not a wheel of meshtrain {dist.version}, the version "
                                    "that runs here (hosts check compares the two)")
        source = "given wheel"
    elif path is not None and direct.get("dir_info", {}).get("editable"):
        wheel, source = build_wheel(path, workdir), "built from the checkout"
    elif path is not None and path.suffix == ".whl" and path.is_file():
        wheel, source = path, "wheel"
    else:
        wheel, source = repack_installed(dist, workdir), "repacked from the installed files"
    return LocalInstall(
        version=dist.version, wheel=wheel, digest=wheel_digest(wheel), pins=dependency_pins(),
        requires_python=dist.metadata["Requires-Python"] or "", source=source,
    )


def installed_distribution(package: str = PACKAGE) -> metadata.Distribution:
    """The distribution pip installed; a checkout's own ``*.egg-info`` (found first when the
    current folder is the checkout) has no INSTALLER file and loses to it."""
    found = list(metadata.distributions(name=package))
    if not found:
        raise LocalInstallError(f"{package} is not installed here (run from a checkout? pip install -e .)")
    return next((d for d in found if d.read_text("INSTALLER") is not None), found[0])


def build_wheel(project: Path, workdir: Path) -> Path:
    """Build the checkout at ``project`` into a wheel in ``workdir`` (offline: no build isolation)."""
    if not (project / "pyproject.toml").is_file() or not (project / PACKAGE).is_dir():
        raise LocalInstallError(f"meshtrain is installed in editable mode from {project}, but that "
                                "folder has no pyproject.toml or meshtrain package any more")
    source = workdir / "source"
    source.mkdir(parents=True)
    for name in PROJECT_FILES:
        if (project / name).is_file():
            shutil.copy2(project / name, source / name)
    for readme in list(project.glob("README*")) + list(project.glob("LICENSE*")):
        if readme.is_file():
            shutil.copy2(readme, source / readme.name)
    shutil.copytree(project / PACKAGE, source / PACKAGE,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = workdir / "wheel"
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
               "--disable-pip-version-check", "-q", "-w", str(out), str(source)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    wheels = sorted(out.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        lines = [x for x in done.stderr.splitlines() if x.strip()] or ["no wheel was written"]
        raise LocalInstallError(f"could not build a wheel of {project}: {lines[-1].strip()}")
    return wheels[0]


def repack_installed(dist: metadata.Distribution, workdir: Path) -> Path:
    """A wheel holding exactly the files pip installed for ``dist`` (scripts left out:
    pip writes them again from the entry points)."""
    files = [f for f in dist.files or [] if not str(f).startswith("..") and f.suffix != ".pyc"
             and f.parts[-1] not in INSTALLER_FILES]
    if not files:
        raise LocalInstallError("meshtrain's installed files are not recorded (no RECORD): reinstall "
                                "it with pip, or from a checkout with `pip install -e`")
    info = f"{dist.metadata['Name']}-{dist.version}.dist-info"
    wheel = workdir / f"{dist.metadata['Name']}-{dist.version}-py3-none-any.whl"
    records: list[str] = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for f in files:
            data = Path(str(dist.locate_file(f))).read_bytes()
            archive.writestr(str(f.as_posix()), data)
            hashed = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            records.append(f"{f.as_posix()},sha256={hashed},{len(data)}")
        records.append(f"{info}/RECORD,,")
        archive.writestr(f"{info}/RECORD", "\n".join(records) + "\n")
    return wheel


def wheel_digest(wheel: Path) -> str:
    """sha256 over the sorted member names and contents of ``wheel`` (zip times ignored)."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive:
            for name in sorted(archive.namelist()):
                digest.update(name.encode() + b"\0")
                digest.update(hashlib.sha256(archive.read(name)).digest())
    except (OSError, zipfile.BadZipFile) as exc:
        raise LocalInstallError(f"{wheel} is not a readable wheel: {exc}") from None
    return digest.hexdigest()


def make_workdir() -> Path:
    """A temporary folder for the wheel; the caller removes it."""
    return Path(tempfile.mkdtemp(prefix="meshtrain-setup-"))
