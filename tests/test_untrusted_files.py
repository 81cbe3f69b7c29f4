"""YAML and JSON that a host wrote (a launched run's copied-back config.yaml and summary.json,
a checkpoint's meta.json) or a user downloaded (a cluster file, an inventory) are read by one
reader, meshtrain.yaml12, within limits on size, aliases and depth; each refusal is one line
naming the file. In-process: the limits are logic, no host is needed to plant the bytes."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from meshtrain import yaml12
from meshtrain.checkpoint import CheckpointError, find_latest
from meshtrain.cluster import ClusterFileError, load_cluster_file
from meshtrain.hosts.host_output import host_json
from meshtrain.hosts.inventory import InventoryError, load_inventory
from meshtrain.runs import RunError, load_run

#: A "billion laughs" of 262 bytes: 9**7 (4.8 million) strings once its aliases are expanded.
ALIAS_BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{n}: &{n} [{','.join(['*' + p] * 9)}]\n" for p, n in zip("abcdef", "bcdefg", strict=True))


def finishes(call: Callable[[], Any], seconds: float = 10.0) -> Any:
    """``call()``'s result or exception, failing the test if it has not returned in ``seconds``
    (a reader blocked on a FIFO never would; the thread is left behind as a daemon)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still reading after {seconds} s (blocked?)"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def run_dir(folder: Path, config: str = "train: {nodes: 2}\n") -> Path:
    folder.mkdir()
    (folder / "summary.json").write_text('{"run_id": "r", "nodes": 2, "steps": 2}')
    (folder / "config.yaml").write_text(config)
    (folder / "metrics.csv").write_text("step,train_loss\n1,0.5\n2,0.4\n")
    return folder


def test_an_alias_bomb_is_refused_before_it_is_expanded() -> None:
    assert len(ALIAS_BOMB) < 300
    started = time.monotonic()
    with pytest.raises(yaml12.Refused, match=r"^more than 200000 values once its aliases are expanded"):
        yaml12.load(ALIAS_BOMB)
    assert time.monotonic() - started < 5
    # Anchors as people use them (defaults merged in) still load, and a self-referencing one is
    # refused as too deep rather than followed.
    assert yaml12.load("base: &b {lr: 1e-3}\nrun: {<<: *b, steps: 5}\n")["run"] == {"lr": 1e-3, "steps": 5}
    with pytest.raises(yaml12.Refused, match=r"nested more than 64 levels deep"):
        yaml12.load("&a [*a]")
    with pytest.raises(yaml12.Refused, match=r"nested more than 64 levels deep"):
        yaml12.load("[" * 70 + "]" * 70)


def test_a_runs_config_alias_bomb_is_one_line_naming_the_file(tmp_path: Path) -> None:
    """A bomb planted as rank 0's config.yaml: the dashboard expanded it on every poll (351 MB
    of JSON at 307 bytes); `meshtrain runs` loaded it too."""
    pytest.importorskip("aiohttp", reason="the dashboard extra is not installed")
    from meshtrain.dashboard.state import DashboardState, RunDirError

    folder = run_dir(tmp_path / "r", ALIAS_BOMB)
    with pytest.raises(RunDirError, match=rf"^{folder / 'config.yaml'}: more than 200000 values once its "
                       r"aliases are expanded \(an alias bomb\?\)$"):
        DashboardState().add_run_directory(folder)
    # The live view of a launch takes the copied-back directory in: refused, the run stays shown.
    live = DashboardState().live_run("r", ["a", "b"], "launch")
    assert live.load_directory(folder) is False
    with pytest.raises(RunError, match=rf"^{folder / 'config.yaml'}: more than 200000 values"):
        load_run(folder)


def test_files_past_the_size_limit_are_refused_naming_file_and_size(tmp_path: Path) -> None:
    big = tmp_path / "cluster.yaml"
    big.write_text("# padding\n" * (yaml12.MAX_BYTES // 10 + 1))
    size = big.stat().st_size
    limit = rf"{size} bytes, more than the {yaml12.MAX_BYTES} a file may have"
    with pytest.raises(ClusterFileError, match=rf"^{big}: {limit}$"):
        load_cluster_file(big)
    inventory = tmp_path / "hosts.yaml"
    os.link(big, inventory)
    with pytest.raises(InventoryError, match=rf"^{inventory}: {size} bytes, more than"):
        load_inventory(inventory)
    folder = run_dir(tmp_path / "r")
    (folder / "summary.json").write_text('{"a": "' + "x" * yaml12.MAX_BYTES + '"}')
    with pytest.raises(RunError, match=rf"^{folder / 'summary.json'}: \d+ bytes, more than the"):
        load_run(folder)


def test_json_from_a_host_is_bounded_in_depth(tmp_path: Path) -> None:
    deep = '{"a": ' + "[" * 100 + "]" * 100 + "}"  # well within json's own recursion limit
    with pytest.raises(ValueError, match=r"nested more than 64 levels deep"):
        host_json(deep)
    with pytest.raises(ValueError, match=r"NaN is not a number"):
        host_json('{"a": NaN}')
    assert host_json('{"a": [[1]]}') == {"a": [[1]]}
    # A checkpoint's meta.json (copied from a host by launch --resume) that is too deep is
    # skipped with its reason, not followed.
    step = tmp_path / "ck" / "step-00000002"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(deep)
    with pytest.raises(CheckpointError, match=r"no complete checkpoint found \(step-00000002: "):
        find_latest(tmp_path / "ck")


def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(tmp_path: Path) -> None:
    """Opened non-blocking and checked before reading: a FIFO would otherwise wait forever for
    a writer that never comes."""
    pytest.importorskip("aiohttp", reason="the dashboard extra is not installed")
    from meshtrain.dashboard.state import DashboardState, RunDirError

    folder = run_dir(tmp_path / "r")
    (folder / "config.yaml").unlink()
    os.mkfifo(folder / "config.yaml")
    with pytest.raises(RunDirError, match=rf"^{folder / 'config.yaml'}: not a regular file$"):
        finishes(lambda: DashboardState().add_run_directory(folder))
    fifo = tmp_path / "cluster.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ClusterFileError, match=rf"^{fifo}: not a regular file$"):
        finishes(lambda: load_cluster_file(fifo))
