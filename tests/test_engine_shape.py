"""engine/ stays readable: no function over 80 lines, and the training step is whole in
train_node (everything else a step does is a callback)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import meshtrain.engine
from meshtrain.engine import callbacks, loop

ENGINE = Path(meshtrain.engine.__file__).resolve().parent
LONGEST = 80


def _functions(path: Path) -> list[tuple[str, int]]:
    """Every function and method in ``path`` (nested ones too) with its length in lines."""
    tree = ast.parse(path.read_text(), str(path))
    return [(f"{path.name}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1)
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None]


def test_no_engine_function_is_longer_than_80_lines() -> None:
    found = [f for path in sorted(ENGINE.rglob("*.py")) for f in _functions(path)]
    assert len(found) > 50  # the walk sees the engine's functions, runtimes included
    too_long = [f"{name} ({lines} lines)" for name, lines in found if lines > LONGEST]
    assert not too_long, too_long


def test_the_walk_would_catch_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(LONGEST))
    (tmp_path / "long.py").write_text(f"class A:\n  def long(self) -> None:\n{body}\n")
    assert _functions(tmp_path / "long.py") == [("long.py:2 long", LONGEST + 1)]


def test_the_step_a_reader_sees_is_short_and_the_rest_are_callbacks() -> None:
    lines = inspect.getsource(loop.train_node).splitlines()
    assert len(lines) <= 60
    names = {c.__name__ for c in callbacks.Callback.__subclasses__()}
    assert {"Faults", "SyncCheck", "NonFiniteGuard", "Validation", "Checkpointing", "ProgressReport",
            "StatusReport"} <= names
