"""The figures the README once quoted for what two hosts wait for each other: the synchronous
wait and speedup ceiling of `benchmarks/core_interference.py`, and the share of all-reduces
rank 0 arrived at last in `benchmarks/scaling.py` (which says whether `--balance` could
help). Checked on step times and traces whose answers are known by hand."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    sys.path.insert(0, str(BENCHMARKS))  # scaling.py imports cpu_sampler from beside it
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def test_a_synchronous_step_waits_for_the_slower_process_and_a_round_for_the_slower_sum() -> None:
    core = load("core_interference")
    # Each process is slow every other step, never both at once: meeting every step, the
    # faster waits 1 s each time; meeting every 2 steps, both rounds took 4 s: no wait.
    a, b = [1.0, 3.0, 1.0, 3.0], [3.0, 1.0, 3.0, 1.0]
    assert core.sync_wait(a, b, 1) == (2.0, 1.0)
    assert core.sync_wait(a, b, 2) == (2.0, 0.0)
    # One steadily slower process: the wait is the difference, whatever the round.
    assert core.sync_wait([1.0] * 4, [2.0] * 4, 1) == (1.5, 0.5)
    assert core.sync_wait([1.0] * 4, [2.0] * 4, 2) == (1.5, 0.5)
    # Steps beyond the last whole round are left out.
    assert core.sync_wait([1.0, 1.0, 9.0], [1.0, 1.0, 1.0], 2) == (1.0, 0.0)


def test_lag1_correlation_tells_drift_from_alternation() -> None:
    core = load("core_interference")
    assert core.lag1_correlation([1.0, 2.0, 1.0, 2.0, 1.0, 2.0]) < -0.8  # alternating
    assert core.lag1_correlation([1.0, 1.0, 1.0, 3.0, 3.0, 3.0]) > 0.4  # slow phases
    assert core.lag1_correlation([2.0, 2.0, 2.0]) == 0.0  # no spread at all


def test_rank0_last_share_counts_the_all_reduces_rank_0_arrived_at_last(tmp_path: Path) -> None:
    scaling = load("scaling")
    # (step, entered, left) per recorded all-reduce, on one monotonic clock.
    rank0 = [[5, 10.0, 10.5], [6, 12.0, 12.2], [7, 14.3, 14.6], [8, 16.0, 16.4]]
    rank1 = [[5, 10.2, 10.5], [6, 11.9, 12.2], [7, 14.1, 14.6], [8, 16.3, 16.4]]
    (tmp_path / "rank0-100.json").write_text(json.dumps(rank0))
    (tmp_path / "rank1-200.json").write_text(json.dumps(rank1))
    waiting, moving, rank0_last = scaling.split_waiting(tmp_path)
    assert rank0_last == 0.5  # last at steps 6 and 7, first at 5 and 8
    assert waiting == pytest.approx(0.2 + 0.3)  # rank 0 waited at steps 5 and 8
    assert moving == pytest.approx(0.3 + 0.2 + 0.3 + 0.1)
    (tmp_path / "rank1-200.json").unlink()
    assert scaling.split_waiting(tmp_path) == (0.0, 0.0, 0.0)  # one rank's trace: nothing to split
