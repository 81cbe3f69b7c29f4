"""The documentation's code works as written.

Which blocks run: a fenced block whose language is ``python`` is a program a reader may copy
whole, so it is run here (in a fresh folder) unless a named test runs it already; a fragment
that needs something this machine lacks (a downloaded model, a finished run) is fenced as
``py`` instead and only shown. Every ``meshtrain ...`` line of a ``bash`` block must name a real
command and only options that command has: the lines are checked against the Typer app itself,
so a renamed flag cannot stay in the docs.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer

from meshtrain.cli.main import app

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)

#: Runnable blocks that a test of their own runs (and checks more closely than "it runs").
RUN_ELSEWHERE = {
    ("docs/reference/python-api.md", 0):
        "tests/test_examples.py::test_the_python_api_pages_example_runs_as_written",
    ("docs/guides/custom-strategy.md", 0):
        "tests/test_custom_strategy.py::test_the_extension_guides_snippet_is_the_example "
        "(it is examples/custom_strategy.py's, which tests/test_examples.py runs)",
}


def blocks(language: str) -> list[tuple[str, int, str]]:
    """(page relative to the repository, index among the page's blocks of that language, code)."""
    found = []
    for page in PAGES:
        fenced = [code for lang, code in FENCE.findall(page.read_text()) if lang == language]
        found += [(str(page.relative_to(ROOT)), i, code) for i, code in enumerate(fenced)]
    return found


PYTHON = blocks("python")


def test_the_block_finder_sees_the_python_api_example() -> None:
    assert ("docs/reference/python-api.md", 0) in {(page, i) for page, i, _ in PYTHON}
    assert all(key in {(page, i) for page, i, _ in PYTHON} for key in RUN_ELSEWHERE)


RUN_HERE = [b for b in PYTHON if b[:2] not in RUN_ELSEWHERE]


@pytest.mark.parametrize(("page", "index", "code"), RUN_HERE, ids=[f"{p}#{i}" for p, i, _ in RUN_HERE])
def test_a_python_block_runs_as_written(page: str, index: int, code: str, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """In a fresh folder (its runs/ land there), with the repository importable as the docs
    say: their examples are run from the repository root."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    exec(compile(code, f"{page}: python block {index}", "exec"), {"__name__": "__docs__"})


def _command_tree() -> Any:
    return typer.main.get_command(app)


def _options(command: Any) -> set[str]:
    ctx = command.context_class(command, info_name="meshtrain")
    names: set[str] = set()
    for param in command.get_params(ctx):
        names.update(getattr(param, "opts", []))
        names.update(getattr(param, "secondary_opts", []))
    return names


def command_lines() -> list[tuple[str, str]]:
    """(page, line) for every line of a bash block that runs meshtrain."""
    found = []
    for page, _, code in blocks("bash"):
        for line in code.replace("\\\n", " ").splitlines():
            line = line.strip()
            for prefix in (".venv/bin/meshtrain ", "meshtrain "):
                if line.startswith(prefix):
                    found.append((page, "meshtrain " + line[len(prefix):]))
    return found


def check_command_line(line: str) -> str | None:
    """What is wrong with one documented ``meshtrain ...`` line, or None."""
    words = shlex.split(line, comments=True)[1:]
    if "--" in words:  # launch ... -- a command for every host: not meshtrain's options
        words = words[:words.index("--")]
    command, path = _command_tree(), ["meshtrain"]
    while hasattr(command, "list_commands") and words and not words[0].startswith("-"):
        ctx = command.context_class(command, info_name=path[-1])
        sub = command.get_command(ctx, words[0])
        if sub is None:
            return f"{' '.join(path)} has no command {words[0]!r}"
        command, path, words = sub, [*path, words[0]], words[1:]
    known = _options(command)
    for word in words:
        option = word.split("=", 1)[0]
        if option.startswith("-") and option != "-" and option not in known:
            return f"{' '.join(path)} has no option {option}"
    return None


COMMAND_LINES = command_lines()


def test_the_command_line_check_sees_a_wrong_option_and_a_wrong_command() -> None:
    assert len(COMMAND_LINES) > 40
    assert check_command_line("meshtrain simulate --nodes 2 --strategy ddp") is None
    assert check_command_line("meshtrain hosts bench hosts/x.yaml --task gpt") is None
    assert check_command_line("meshtrain simulate --nodez 2") == "meshtrain simulate has no option --nodez"
    assert check_command_line("meshtrain hosts bnech x.yaml") == "meshtrain hosts has no command 'bnech'"


def test_every_documented_command_line_names_real_commands_and_options() -> None:
    wrong = [f"{page}: {line}: {problem}" for page, line in COMMAND_LINES
             if (problem := check_command_line(line)) is not None]
    assert not wrong, "\n".join(wrong)
