"""A new built-in strategy is one file: the registry finds every strategy class that a
module of meshtrain/strategies/ defines with its own name."""

from __future__ import annotations

import ast
import copy
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import meshtrain.strategies
from meshtrain.strategies import STRATEGIES

PACKAGE = Path(meshtrain.strategies.__file__).resolve().parent

NEW_STRATEGY = '''
from meshtrain.strategies.ddp import DDP


class Halved(DDP):
    """DDP, listed last: only here to show that a file is all a strategy needs."""

    name = "halved"
    display_name = "Halved"
    listing_order = 1000
'''


def _named_classes(path: Path) -> set[str]:
    """The ``name = "..."`` of every class in ``path``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if (isinstance(item, ast.Assign) and len(item.targets) == 1
                        and isinstance(item.targets[0], ast.Name) and item.targets[0].id == "name"
                        and isinstance(item.value, ast.Constant)):
                    names.add(item.value.value)
    return names


def test_the_registry_holds_every_strategy_class_of_the_package_in_listing_order() -> None:
    defined = set().union(*(_named_classes(p) for p in PACKAGE.glob("*.py") if p.name != "base.py"))
    assert set(STRATEGIES) == defined
    assert list(STRATEGIES)[:6] == ["ddp", "diloco", "sparta", "sparta-diloco", "fedavg", "demo"]


def test_a_new_file_in_a_copy_of_the_package_is_a_strategy_the_cli_runs(tmp_path: Path) -> None:
    copy = tmp_path / "meshtrain"
    shutil.copytree(PACKAGE.parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "strategies" / "halved.py").write_text(NEW_STRATEGY)
    listed = subprocess.run([sys.executable, "-c", "from meshtrain.strategies import STRATEGIES; "
                             "print(','.join(STRATEGIES))"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split()[-1].split(",")[-1] == "halved"
    ran = subprocess.run([sys.executable, "-m", "meshtrain", "simulate", "--strategy", "halved", "--nodes",
                          "2", "--steps", "3", "--no-progress", "--out", str(tmp_path / "runs")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert "halved" in ran.stdout.lower()


# ------------------------------------------------- "when did this strategy last sync"
SYNCS_AFTER = {  # the built-ins: steps done at each step's end when the nodes last synced
    "ddp": [1, 2, 3, 4, 5, 6, 7],  # gradients averaged every step
    "demo": [1, 2, 3, 4, 5, 6, 7],
    "sparta": [1, 2, 3, 4, 5, 6, 7],  # a fraction of the parameters every step
    "diloco": [None, None, 3, 3, 3, 6, 6],  # the outer sync every H=3 steps
    "fedavg": [None, None, 3, 3, 3, 6, 6],
    "sparta-diloco": [None, None, 3, 3, 3, 6, 6],  # its full sync is DiLoCo's
}


def _last_syncs(name: str, steps: int = 7) -> list[list[int | None]]:
    """What each of 2 nodes' heartbeat reports as its last sync (``strategy.last_synced()``)
    after every step, then after ``finish``, for ``name`` with H=3 where it has an H, on real
    thread communicators."""
    from helpers import MLP, regression_data

    from meshtrain.comm import ThreadCommunicator, ThreadHub
    from meshtrain.heartbeat import last_sync_step

    cls = STRATEGIES[name]
    # Streaming DiLoCo's fragments (4 by default) each sync at their own step of the H.
    options = {k: v for k, v in {"H": 3, "fragments": 3}.items() if k in cls.parameters()}
    strategy = cls(**options)
    hub, data = ThreadHub(2), regression_data(64)
    seen: list[list[int | None]] = [[], []]
    errors: list[BaseException] = []

    def node(rank: int) -> None:
        try:
            run_node(rank)
        except BaseException as exc:  # noqa: BLE001 - raised by the test below
            errors.append(exc)
            hub.abort(exc)

    def run_node(rank: int) -> None:
        comm, own = ThreadCommunicator(hub, rank), copy.deepcopy(strategy)
        model = MLP()
        comm.step = -1
        own.setup(model, comm, seed=0, max_steps=steps, num_samples=32)
        seen[rank].append(last_sync_step(own))
        for step in range(steps):
            comm.step = step
            rows = slice(rank + 8 * step, rank + 8 * step + 8, 2)  # 4 samples of this node's shard
            model((data.tensors[0][rows], data.tensors[1][rows])).backward()
            own.step(step)
            seen[rank].append(last_sync_step(own))
        own.finish(steps - 1)
        seen[rank].append(last_sync_step(own))

    threads = [threading.Thread(target=node, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    assert all(len(s) == steps + 2 for s in seen), seen
    return seen


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_says_when_it_last_synced(name: str) -> None:
    """The launch's live view read a ``last_sync`` attribute only DiLoCo's module had: FedAvg's
    "last sync" stayed empty. Every registered strategy answers ``last_synced()``: None
    before any sync, and every node holds the global model after ``finish`` (the last step).
    A strategy added without an answer of its own gets the default: the last step it
    communicated in."""
    for seen in _last_syncs(name):
        assert seen[0] is None  # nothing synced before step 1 (start-up traffic is no sync)
        assert seen[-1] == 7  # the final sync
        during = seen[1:-1]
        if name in SYNCS_AFTER:
            assert during == SYNCS_AFTER[name]
        assert all(v is None or 1 <= v <= step for step, v in enumerate(during, start=1)), during
        assert [v for v in during if v is not None] == sorted(v for v in during if v is not None)
