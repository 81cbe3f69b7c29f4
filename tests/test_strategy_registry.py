"""A new built-in strategy is one file: the registry finds every strategy class that a
module of meshtrain/strategies/ defines with its own name."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

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
