"""CPU seconds per test of the suite, every process a test starts included (Linux, root).

``--durations`` gives wall-clock, which under 3 xdist workers on 2 cores says how long a
test waited as much as what it cost. This pytest plugin moves each worker into a cgroup of
its own and reads the group's CPU time around every test, so whatever the test started (a
`meshtrain` subprocess, a launch's ranks under the session's sshd, pip) counts towards it:
those are born inside their worker's group. cgroup v2 (``cpu.stat``'s ``usage_usec``) where
the unified hierarchy is mounted at /sys/fs/cgroup or /sys/fs/cgroup/unified, else v1's
``cpuacct.usage`` (accounting only: tests/cpu_limits.py's groups set quotas, and need the
cpu controller). A test's figure also holds what the worker's session-wide processes (the
shared sshd worlds) used meanwhile, which is small.

    PYTHONPATH=benchmarks python -m pytest -p suite_cpu      # writes suite-cpu/<worker>.jsonl
    python benchmarks/suite_cpu.py suite-cpu                  # the table: files, then tests

The folder is ``MESHTRAIN_SUITE_CPU`` (default ``suite-cpu`` in the current directory); a
run appends to it, so remove it between runs.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from collections.abc import Generator
from pathlib import Path

import pytest

OUT = Path(os.environ.get("MESHTRAIN_SUITE_CPU", "suite-cpu"))
V2_ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
V1_ROOT = Path("/sys/fs/cgroup/cpuacct")


class WorkerGroup:
    """A cgroup holding this pytest process (and so everything it starts from now on)."""

    def __init__(self, name: str) -> None:
        self.name = name
        v2 = next((root for root in V2_ROOTS
                   if (root / "cgroup.procs").is_file() and (root / "cpu.stat").is_file()), None)
        if v2 is not None:
            self.path, self.version = v2 / f"meshtrain-suite-cpu-{name}", 2
        elif (V1_ROOT / "cpuacct.usage").is_file():
            self.path, self.version = V1_ROOT / f"meshtrain-suite-cpu-{name}", 1
        else:
            raise pytest.UsageError("suite_cpu: no cgroup v2 cpu.stat and no cgroup v1 cpuacct here")
        self.path.mkdir(exist_ok=True)
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        """Back to the parent group, then the group goes (if nothing the run started is left in it)."""
        (self.path.parent / "cgroup.procs").write_text(str(os.getpid()))
        try:
            self.path.rmdir()
        except OSError:
            pass

    def cpu_seconds(self) -> float:
        if self.version == 2:
            stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
            return int(stat["usage_usec"]) / 1e6
        return int((self.path / "cpuacct.usage").read_text()) / 1e9


_group: WorkerGroup | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _group
    _group = WorkerGroup(os.environ.get("PYTEST_XDIST_WORKER", "main"))
    OUT.mkdir(exist_ok=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _group is not None:
        _group.remove()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    assert _group is not None
    before = _group.cpu_seconds()
    yield
    record = {"test": item.nodeid, "cpu": _group.cpu_seconds() - before}
    with open(OUT / f"{_group.name}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def report(folder: Path, top: int) -> None:
    """The files and the tests that used the most CPU, from a run's records."""
    from rich.table import Table

    from meshtrain.tables import print_fitted

    records = [json.loads(line) for path in sorted(folder.glob("*.jsonl")) for line in path.open()]
    if not records:
        raise SystemExit(f"{folder}: no records (run pytest with -p suite_cpu first)")
    total = sum(r["cpu"] for r in records)
    per_file: Counter[str] = Counter()
    for r in records:
        per_file[r["test"].split("::")[0]] += r["cpu"]
    files = Table(title=f"CPU s per file ({len(records)} tests, {total:,.0f} s)")
    for column in ("file", "CPU s", "share"):
        files.add_column(column, justify="left" if column == "file" else "right")
    for name, cpu in per_file.most_common(top):
        files.add_row(name, f"{cpu:.1f}", f"{cpu / total:.1%}")
    print_fitted(files, piped_width=200)
    tests = Table(title=f"The {top} tests that used the most CPU")
    for column in ("test", "CPU s"):
        tests.add_column(column, justify="left" if column == "test" else "right")
    for r in sorted(records, key=lambda r: -r["cpu"])[:top]:
        tests.add_row(r["test"], f"{r['cpu']:.1f}")
    print_fitted(tests, piped_width=200)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Print where a suite run's CPU went.")
    parser.add_argument("folder", type=Path, nargs="?", default=OUT)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    report(args.folder, args.top)
