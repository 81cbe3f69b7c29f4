"""CPU quotas for test hosts: a cgroup with a CFS bandwidth limit that a host's sshd (and so
every process it starts, a launched rank included) is moved into.

cgroup v2 (``cpu.max``, ``cpu.weight``) where the unified hierarchy has the cpu controller,
else cgroup v1 (``cpu.cfs_quota_us``, ``cpu.cfs_period_us``, ``cpu.shares``); neither: the
test skips, naming what was missing. Each group also gets the highest weight there is, so on
a machine other work keeps busy the capped hosts still get their quota (the comparison needs
a known speed ratio, not whatever the neighbours leave). The weight has to be the highest:
the suite's other workers put 10 to 20 runnable threads in the root group, each weighing
1024, and at v1's former 10240 a group was owed 2 x 10240 / (16 x 1024 + 2 x 10240) = 0.55
cores beside 16 busy threads, so the "one core" host ran as fast as the half-core one.
At the highest weight it is owed more than its quota, and the quota is what binds.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path("/sys/fs/cgroup")
#: Held by a test whose hosts must run at a known ratio of speeds (see :func:`quotas_alone`);
#: one path for every pytest process on this machine, xdist's workers included.
QUOTA_LOCK = Path(tempfile.gettempdir()) / "meshtrain-test-cpu-quotas.lock"
PERIOD_US = 10_000  # 10 ms: a short period spreads the quota evenly over a training step
WEIGHT_V2 = 10_000  # cpu.weight's highest (default 100)
SHARES_V1 = 262_144  # cpu.shares' highest (default 1024)


class CpuGroup:
    """One cgroup holding at most ``cores`` CPUs' worth of time."""

    def __init__(self, root: Path, version: int, name: str, cores: float) -> None:
        self.root, self.version = root, version
        self.path = root / f"meshtrain-test-{name}-{os.getpid()}"
        self.path.mkdir()
        quota = max(1000, int(cores * PERIOD_US))
        if version == 2:
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            (self.path / "cpu.weight").write_text(str(WEIGHT_V2))
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
            (self.path / "cpu.shares").write_text(str(SHARES_V1))

    def add(self, pid: int) -> None:
        """Move ``pid`` in; the processes it starts from now on are born inside."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def delete(self) -> None:
        """Move whatever is still inside back to the root group, then remove the group."""
        deadline = time.monotonic() + 10
        while True:
            for pid in (self.path / "cgroup.procs").read_text().split():
                try:
                    (self.root / "cgroup.procs").write_text(pid)
                except OSError:
                    pass  # it ended meanwhile
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def cpu_cgroups() -> tuple[Path, int]:
    """Where CPU-limited groups can be made here, and the cgroup version; skips the test
    with the reason when nowhere."""
    controllers = ROOT / "cgroup.controllers"
    if controllers.is_file() and "cpu" in controllers.read_text().split():
        subtree = ROOT / "cgroup.subtree_control"
        if "cpu" not in subtree.read_text().split():
            try:
                subtree.write_text("+cpu")
            except OSError as exc:
                pytest.skip(f"cgroup v2: cannot enable the cpu controller in {subtree} ({exc})")
        return ROOT, 2
    v1 = ROOT / "cpu"
    if (v1 / "cpu.cfs_quota_us").is_file():
        if not os.access(v1, os.W_OK):
            pytest.skip(f"cgroup v1: {v1} is not writable (not root, or mounted read-only)")
        return v1, 1
    pytest.skip(f"no cgroup cpu controller: {controllers} lacks cpu and {v1}/cpu.cfs_quota_us is absent")


@contextmanager
def held_back(pid: int, cores: float, name: str) -> Iterator[None]:
    """Process ``pid`` held to ``cores`` CPUs' worth of time until the block ends (then it
    runs free again). Skips, naming why, where no cgroup cpu controller is writable."""
    root, version = cpu_cgroups()
    group = CpuGroup(root, version, name, cores)
    try:
        group.add(pid)
        yield
    finally:
        group.delete()


@contextmanager
def quotas_alone() -> Iterator[None]:
    """While the block runs, no other test's hosts hold a speed ratio's quotas: a test whose
    hosts must run at a known ratio (one core against half of one) takes this first. Two such
    tests at once asked for 3 cores of quota at the highest weight on a 2-core machine, each
    group then got about half a core, and the "one core" host measured no faster than the
    half-core one (a full suite: the balance test beside the async-diloco one)."""
    with open(QUOTA_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield
