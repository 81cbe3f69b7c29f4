"""What a process reads from its environment is read in one place (config/environment.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from meshtrain.config.environment import (
    LaunchedRank,
    cores_per_local_rank,
    launched_rank,
    writes_run_directory,
)
from meshtrain.errors import SettingError

PACKAGE = Path(__file__).resolve().parent.parent / "meshtrain"


def test_launched_rank_is_decided_by_rank_and_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launched_rank() is None and writes_run_directory()
    monkeypatch.setenv("RANK", "1")
    assert launched_rank() is None  # RANK alone is not a launch
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launched_rank() == LaunchedRank(1, 2) and not writes_run_directory()
    monkeypatch.setenv("RANK", "0")
    assert writes_run_directory()
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(SettingError, match="RANK must be a whole number of at least 0, got 'one'"):
        launched_rank()


def test_a_launched_ranks_cores_are_shared_by_the_ranks_on_its_machine() -> None:
    cores = len(os.sched_getaffinity(0))
    assert cores_per_local_rank({}) == cores  # alone on its machine: every core
    assert cores_per_local_rank({"LOCAL_WORLD_SIZE": "2"}) == max(1, cores // 2)
    assert cores_per_local_rank({"LOCAL_WORLD_SIZE": str(cores + 1)}) == 1  # at least one each
    with pytest.raises(SettingError, match="LOCAL_WORLD_SIZE must be a whole number of at least 1, got '0'"):
        cores_per_local_rank({"LOCAL_WORLD_SIZE": "0"})


def test_no_other_module_reads_the_rank_from_the_environment() -> None:
    """'Am I a launched rank?' has one answer: a second reader would drift from it."""
    reads = re.compile(r"""environ(\.get\(|\[)\s*["'](RANK|WORLD_SIZE|MESHTRAIN_THREADS)["']""")
    readers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if reads.search(p.read_text()))
    assert readers == ["config/environment.py"]
