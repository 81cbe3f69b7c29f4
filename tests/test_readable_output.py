"""Output a person can read: whole tables when piped, help text that keeps its brackets and
says the real defaults, plurals, and errors that name the file and what kind it is."""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import typer
from terminal import ANSI, run_on_a_terminal
from typer.testing import CliRunner

from meshtrain.cli.main import app

runner = CliRunner()


def piped(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``meshtrain ARGS`` with stdout a pipe and no COLUMNS: what `| tee log` sees."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "RANK", "WORLD_SIZE")}
    return subprocess.run([sys.executable, "-m", "meshtrain", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_piped_tables_are_not_cut_at_80_columns(tmp_path: Path) -> None:
    listed = piped("profiles", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if "whisper-tiny-random-lora " in line)
    assert row.rstrip().endswith("whisper-tiny-random-lora.yaml │")  # name, description, path: one line
    assert "(python -m meshtrain.hf.tiny)" in row

    ran = piped("simulate", "--steps", "2", "--nodes", "1", "--no-progress", "--run-id",
                "a-run-with-a-rather-long-name-to-show", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "diloco on 1 node\n" in ran.stdout or "diloco on 1 node " in ran.stdout
    assert "1 nodes" not in ran.stdout
    runs = piped("runs", cwd=tmp_path)
    assert runs.returncode == 0, runs.stderr
    row = next(line for line in runs.stdout.splitlines() if "a-run-with-a-rather-long-name-to-show" in line)
    assert len(row) > 80 and "DiLoCo H=25" in row and row.rstrip().endswith("s │")  # one row, every column


def test_profiles_on_an_80_column_terminal_shows_every_name_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile's name is what --profile takes: at 80 columns rich cut it to
    "whisper-tiny-random-lo…" (and every file path); now each profile is its name on a line."""
    from meshtrain.cli import main
    from meshtrain.config.profiles import list_profiles

    monkeypatch.setattr(main.console, "_width", 80)
    result = runner.invoke(app, ["profiles"])
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    lines = result.output.splitlines()
    text = " ".join(result.output.split())
    for name, path in list_profiles().items():
        assert name in lines and str(path) in text, name


def test_help_keeps_brackets_and_names_the_task_defaults() -> None:
    result = runner.invoke(app, ["simulate", "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert result.exit_code == 0
    text = " ".join(result.output.replace("│", " ").split())
    assert "pip install 'meshtrain[wandb]'" in text
    assert "pip install 'meshtrain[tensorboard]'" in text
    assert "default: the task's suggestion, digits 300, gpt 200, whisper 200" in text
    listed = runner.invoke(app, ["settings"])
    assert "pip install 'meshtrain[wandb]'" in " ".join(listed.output.replace("│", " ").split())


Documented = list[tuple[tuple[str, ...], Callable[..., Any]]]


def _documented_commands(app: typer.Typer, path: tuple[str, ...] = ()) -> Documented:
    """(command path, callback) of every command of ``app`` that has a docstring."""
    found = [((*path, c.name or c.callback.__name__), c.callback) for c in app.registered_commands
             if c.callback is not None and c.callback.__doc__]
    for group in app.registered_groups:
        assert group.typer_instance is not None and group.name is not None
        found += _documented_commands(group.typer_instance, (*path, group.name))
    return found


COMMANDS = _documented_commands(app)


@pytest.mark.parametrize(("path", "callback"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_help_wraps_a_paragraph_where_the_terminal_ends_and_keeps_examples_indented(
        path: tuple[str, ...], callback: Callable[..., Any]) -> None:
    """The docstring's line breaks are the source's, not the terminal's: on a wide terminal a
    prose paragraph is one line, and an example keeps its indentation (typer had kept the
    breaks, and dropped the indentation where one prose line preceded the examples)."""
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "1000"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for paragraph in inspect.cleandoc(callback.__doc__ or "").split("\n\n"):
        prose = " ".join(line.strip() for line in paragraph.splitlines() if not line.startswith(" "))
        assert any(prose in line for line in lines), f"{' '.join(path)}: not on one line: {prose!r}"
        for example in (line for line in paragraph.splitlines() if line.startswith(" ")):
            assert any(re.fullmatch(rf" {re.escape(example)}\s*", line) for line in lines), \
                f"{' '.join(path)}: example not indented as written: {example!r}"
    # On an 80-column terminal an example is still one line, to copy whole.
    narrow = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80"}).output.splitlines()
    for paragraph in inspect.cleandoc(callback.__doc__ or "").split("\n\n"):
        for example in (line for line in paragraph.splitlines() if line.startswith(" ")):
            assert any(re.fullmatch(rf" {re.escape(example)}\s*", line) for line in narrow), \
                f"{' '.join(path)}: example wraps at 80 columns: {example!r}"
    listed = runner.invoke(app, [*path[:-1], "--help"], env={"COLUMNS": "1000"})
    first = " ".join(inspect.cleandoc(callback.__doc__ or "").split("\n\n")[0].split())
    assert any(first in line for line in listed.output.splitlines()), f"{path[-1]}'s summary is cut"


def test_wrong_kind_and_undecodable_files_are_named(tmp_path: Path) -> None:
    folder = tmp_path / "text-folder"
    folder.mkdir()
    result = runner.invoke(app, ["simulate", "--task", "gpt", "--data", str(folder), "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: task 'gpt': {folder} is a folder; --data takes one text file"

    ran = runner.invoke(app, ["simulate", "--steps", "2", "--nodes", "1", "--no-progress",
                              "--out", str(tmp_path / "runs"), "--run-id", "r"])
    assert ran.exit_code == 0, ran.output
    broken = tmp_path / "runs" / "broken"
    shutil.copytree(tmp_path / "runs" / "r", broken)
    (broken / "summary.json").write_text('{"strategy": "diloco",')
    plotted = runner.invoke(app, ["plot", str(broken), "--out", str(tmp_path / "plots")])
    assert plotted.exit_code == 2
    assert plotted.output.startswith(f"error: {broken / 'summary.json'}: not valid JSON (line 1: ")
    (broken / "summary.json").write_text('{"a": ' + "[" * 5000 + "]" * 5000 + "}")  # deeper than json follows
    plotted = runner.invoke(app, ["plot", str(broken), "--out", str(tmp_path / "plots")])
    assert plotted.exit_code == 2 and "Traceback" not in plotted.output
    assert plotted.output.strip() == (f"error: {broken / 'summary.json'}: nested too deeply; "
                                      "not a finished run")
    (broken / "summary.json").write_bytes(b"\xff\xfe\x00garbage")
    plotted = runner.invoke(app, ["plot", str(broken), "--out", str(tmp_path / "plots")])
    assert plotted.output.strip() == (f"error: {broken / 'summary.json'}: not UTF-8 text (damaged?); "
                                      "not a finished run")
    # A field longer than csv reads (131,072 characters) raised _csv.Error: a traceback.
    shutil.copy(tmp_path / "runs" / "r" / "summary.json", broken / "summary.json")
    with (broken / "metrics.csv").open("a") as f:
        f.write("9," + "1" * 200_000 + "\n")
    plotted = runner.invoke(app, ["plot", str(broken), "--out", str(tmp_path / "plots")])
    assert plotted.exit_code == 2 and plotted.output.strip() == (
        f"error: {broken / 'metrics.csv'}: unreadable (field larger than field limit (131072)); "
        "not a finished run")


def test_the_projected_total_reads_as_the_sum_of_its_parts(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Path) -> None:
    """Two decimals had shown a 0.0705 s projection as "0.07 s (compute 0.04 s +
    communication 0.04 s)"; with a probed cluster the hosts' wait was in the total but not
    among its parts."""
    from meshtrain.cli import main

    monkeypatch.setattr(main.console, "_width", 120)
    summary = {"strategy": "ddp", "nodes": 2, "steps": 10, "final_train_loss": 1.0,
               "bytes_sent_per_node": 10, "trainable_parameters": 3, "wall_seconds": 1.0,
               "projected": {"cluster": "gbe", "compute_seconds": 0.03524,
                             "communication_seconds": 0.03526, "total_seconds": 0.0705}}
    main.print_summary(summary, tmp_path)
    assert "0.0705 s (compute 0.0352 s + communication 0.0353 s)" in capsys.readouterr().out
    summary["projected"] = {"cluster": "lab", "compute_seconds": 12.0, "communication_seconds": 3.5,
                            "sync_wait_seconds": 0.25, "total_seconds": 15.75}
    main.print_summary(summary, tmp_path)
    assert "15.8 s (compute 12 s + communication 3.5 s + waiting for the slowest host 0.25 s)" \
        in capsys.readouterr().out


WIDE_TABLE_PROGRAM = """
from rich.table import Table
from meshtrain.tables import print_fitted

table = Table(title="a benchmark")
for name in ("strategy", "plain loop", "threads", "threads / plain", "per step", "CPU s", "CPU ratio",
             "processes", "processes / plain", "per step (processes)"):
    table.add_column(name)
table.add_row("[bold]ddp[/]", "1.04 s", "1.57 s", "1.51x", "1.39x (7.19 ms)", "1.04", "1.88x (1.96 s)",
              "2.35 s", "2.26x", "1.89x (9.80 ms)")
print_fitted(table, piped_width=200)
"""


def test_a_benchmarks_table_fits_the_terminal_and_stays_whole_when_piped(tmp_path: Path) -> None:
    """`python benchmarks/runtimes.py` printed its 240-column table at 240 columns on an
    80-column terminal too (every line wrapped by the terminal); piped, a table keeps the
    width the README's copies of it have."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    code, shown = run_on_a_terminal([sys.executable, "-c", WIDE_TABLE_PROGRAM], tmp_path,
                                    {**env, "TERM": "xterm-256color"}, columns=80, timeout=120)
    lines = [line.rstrip() for line in ANSI.sub("", shown).replace("\r", "").splitlines() if line.strip()]
    assert code == 0 and lines[:2] == ["a benchmark", "ddp"], lines
    assert max(len(line) for line in lines) <= 80 and "…" not in shown and "[bold]" not in shown, lines
    joined = " ".join(lines)
    assert "processes / plain 2.26x" in joined and "per step (processes) 1.89x (9.80 ms)" in joined
    piped = subprocess.run([sys.executable, "-c", WIDE_TABLE_PROGRAM], capture_output=True, text=True,
                           env=env, timeout=120)
    assert piped.returncode == 0 and "┃ processes / plain ┃" in piped.stdout, piped.stdout
    assert max(len(line) for line in piped.stdout.splitlines()) > 80  # the whole table, one row a line
