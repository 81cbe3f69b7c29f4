"""One place decides whether this process is a launched rank, and runtimes are a registry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import meshtrain
from meshtrain.config.environment import LaunchedRank, launched_rank
from meshtrain.config.settings import RUNTIMES
from meshtrain.engine import runtimes
from meshtrain.errors import InputError

PACKAGE = Path(meshtrain.__file__).resolve().parent


def test_runtimes_the_settings_accept_are_the_registered_ones() -> None:
    assert tuple(runtimes.RUNNERS) == RUNTIMES


def test_a_process_without_rank_and_world_size_is_not_launched() -> None:
    assert launched_rank({}) is None
    assert launched_rank({"RANK": "0"}) is None
    assert launched_rank({"WORLD_SIZE": "2"}) is None


def test_a_launched_rank_reads_its_place_and_rendezvous() -> None:
    place = launched_rank({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                           "MESHTRAIN_TIMEOUT": "90"})
    assert place == LaunchedRank(1, 2, "10.0.0.1", 29500, 90.0)
    assert place.rendezvous() == ("10.0.0.1", 29500)
    torchrun = launched_rank({"RANK": "0", "WORLD_SIZE": "1"})
    assert torchrun is not None and torchrun.timeout_s is None
    with pytest.raises(InputError, match="missing environment variables: MASTER_ADDR, MASTER_PORT"):
        torchrun.rendezvous()


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK must be a whole number of at least 0, got 'x'"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE must be a whole number of at least 1, got '0'"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT must be a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MESHTRAIN_TIMEOUT": "nan"}, "MESHTRAIN_TIMEOUT must be a positive"),
])
def test_a_bad_rank_environment_names_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(InputError, match=re.escape(message)):
        launched_rank(env)


def test_no_other_module_reads_the_rank_variables_from_the_environment() -> None:
    reads = re.compile(r"""environ(?:\.get\(|\[)\s*["'](?:RANK|WORLD_SIZE|MASTER_ADDR|MASTER_PORT)["']"""
                       r"""|["'](?:RANK|WORLD_SIZE)["']\s+in\s+os\.environ""")
    readers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if reads.search(p.read_text()))
    assert readers == [], readers


def test_the_trainer_joins_as_the_launched_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from helpers import MLP, regression_data

    from meshtrain import Trainer

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    job = Trainer(MLP(), regression_data(48)).prepare(out_dir=tmp_path, batch_size=4, progress=False)
    # Rank 1 of 3: the launched runtime, and no run directory (only rank 0 writes one).
    assert (job.config.runtime, job.config.nodes, job.run_dir) == ("launched", 3, None)
    with pytest.raises(ValueError, match="nodes=2 but this launched run has WORLD_SIZE=3"):
        Trainer(MLP(), regression_data(48)).prepare(nodes=2, out_dir=tmp_path, progress=False)
