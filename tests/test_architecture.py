"""The package's import graph has no circles, and nothing outside the CLI imports it.

The graph is read from the source with ``ast``: every import counts, at module level
(``TYPE_CHECKING`` blocks included) and inside functions alike, so an import hidden in a
function to dodge a circle is still seen as the arrow it is.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import meshtrain

PACKAGE = Path(meshtrain.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """For every module of the package, the package modules it imports (anywhere in it)."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importing module's package
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[:len(package) - node.level + 1]
                    base = ".".join([*package, *([base] if base else [])])
                # ``from pkg import sub`` imports the module pkg.sub when there is one.
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base
                               for a in node.names)
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path[path.index(target):], target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_the_graph_reader_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "meshtrain.comm.communicator" in graph["meshtrain.comm"]  # from-import in a package face
    assert "meshtrain.config.settings" in graph["meshtrain.config.spec"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_only_the_cli_imports_the_cli() -> None:
    offenders = sorted(
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if not module.startswith("meshtrain.cli") and module != "meshtrain.__main__"
        for target in targets if target.startswith("meshtrain.cli")
    )
    assert not offenders, "the library imports the CLI: " + "; ".join(offenders)


def test_the_research_library_loads_neither_the_cli_nor_ssh() -> None:
    """``meshtrain.compare`` is a library: importing it must not pull in the command line
    or the SSH stack (paramiko)."""
    code = ("import sys, meshtrain.compare; "
            "print(sorted(m for m in sys.modules if m == 'paramiko' or m.startswith('meshtrain.cli') "
            "or m.startswith('meshtrain.launch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_up_runs_the_functions_commands_run_never_another_command() -> None:
    """``meshtrain up`` is a command like the others: its steps call library functions (and
    the CLI's printing of them), not other commands' functions or the app's registry."""
    from meshtrain.cli import up
    from meshtrain.cli.main import app

    def callbacks(typer_app: Any) -> Iterator[Any]:
        yield from (c.callback for c in typer_app.registered_commands)
        for group in typer_app.registered_groups:
            yield from callbacks(group.typer_instance)

    commands = {id(c) for c in callbacks(app) if c is not None and c is not up.up}
    assert len(commands) > 10  # the walk sees the commands (launch, hosts bench, ...)
    assert [name for name, value in vars(up).items() if id(value) in commands] == []
    assert "registered_commands" not in Path(up.__file__).read_text()


def test_the_architecture_pages_layout_names_every_module() -> None:
    """The Layout of docs/design/architecture.md is how a newcomer finds their way: a module it
    leaves out is one they cannot find. Each file is named there (packages' own files by name,
    inside its folder's entry; a folder of one kind, such as strategies/ or tasks/, by the folder)."""
    page = (PACKAGE.parent / "docs" / "design" / "architecture.md").read_text()
    layout = page[page.index("\n## Layout\n"):]
    layout = layout[:layout.find("\n## ", 1) if "\n## " in layout[1:] else None]
    whole_folders = {"strategies", "tasks", "hf", "dashboard", "profiles"}
    missing = [str(p.relative_to(PACKAGE)) for p in sorted(PACKAGE.rglob("*.py"))
               if p.stem not in ("__init__", "__main__")
               and not whole_folders & set(p.relative_to(PACKAGE).parts[:-1])
               and not re.search(rf"\b{re.escape(p.stem)}\b", layout)]
    assert not missing, f"docs/design/architecture.md's Layout leaves out: {missing}"
