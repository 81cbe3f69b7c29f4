"""`meshtrain compare`, `meshtrain plot` and `meshtrain runs` on real (small) digits runs."""

from __future__ import annotations

import csv
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_process import run_cli
from typer.testing import CliRunner

from meshtrain.cli.main import app
from meshtrain.compare import CompareSpec, plan, summarise
from meshtrain.config.spec import ConfigError
from meshtrain.runs import list_runs, load_run

runner = CliRunner()
STRATEGIES = ["ddp", "diloco", "sparta", "fedavg"]


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One small comparison through the real entry point: 40 steps, validated every 10."""
    cwd = tmp_path_factory.mktemp("compare")
    proc = run_cli("compare", "--strategies", ",".join(STRATEGIES), "--steps", "40", "--cluster", "wifi",
                   "--set", "val_interval=10", "--set", "diloco.H=10", "--set", "fedavg.H=5",
                   "--set", "sparta.p=0.01", "--no-progress", cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    (folder,) = (cwd / "runs").iterdir()
    return folder, proc.stdout


def test_compare_writes_one_run_directory_per_strategy_and_the_comparison_files(compared) -> None:
    folder, _ = compared
    assert folder.name.startswith("compare-")
    for name in STRATEGIES:
        for file in ("config.yaml", "metrics.csv", "summary.json", "model.pt", "loss.png", "log.txt"):
            assert (folder / name / file).is_file(), (name, file)
    for file in ("comparison.json", "comparison.csv"):
        assert (folder / file).is_file()
    for plot in ("val_loss_vs_steps", "val_loss_vs_bytes", "val_loss_vs_time"):
        png = (folder / f"{plot}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 15_000  # axes, four lines and a legend
        svg = (folder / f"{plot}.svg").read_text()
        assert "<svg" in svg and svg.count("<path") > 50
        for label in ("DDP", "DiLoCo H=10", "SPARTA p=0.01", "FedAvg H=5"):
            assert label.replace(" ", "") in svg.replace(" ", "") or label in svg


def test_every_run_has_identical_conditions_but_its_own_strategy(compared) -> None:
    folder, _ = compared
    configs = {n: yaml.safe_load((folder / n / "config.yaml").read_text()) for n in STRATEGIES}
    summaries = {n: json.loads((folder / n / "summary.json").read_text()) for n in STRATEGIES}
    for name in STRATEGIES:
        spec = configs[name]["spec"]
        assert (spec["seed"], spec["nodes"], spec["steps"], spec["task"], spec["cluster"]) == \
            (0, 4, 40, "digits", "wifi")
        assert configs[name]["strategy"]["name"] == name
    assert configs["diloco"]["strategy"]["H"] == 10 and configs["fedavg"]["strategy"]["H"] == 5
    assert configs["sparta"]["strategy"]["p"] == 0.01
    # The same initial weights and validation data: the step-0 evaluation is bit-identical.
    initial = {json.dumps(s["initial"]) for s in summaries.values()}
    assert len(initial) == 1


def test_table_and_files_hold_each_runs_own_numbers(compared) -> None:
    folder, stdout = compared
    document = json.loads((folder / "comparison.json").read_text())
    rows = {r["strategy"]: r for r in document["runs"]}
    csv_rows = {r["strategy"]: r for r in csv.DictReader((folder / "comparison.csv").open())}
    ddp_sent = json.loads((folder / "ddp" / "summary.json").read_text())["bytes_sent_per_node"]
    assert document["target_loss"] == pytest.approx(1.05 * rows["ddp"]["final_val_loss"])
    for name in STRATEGIES:
        summary = json.loads((folder / name / "summary.json").read_text())
        row = rows[name]
        assert row["final_val_loss"] == summary["final_val_loss"]
        assert row["bytes_sent_per_node"] == summary["bytes_sent_per_node"]
        assert row["projected_seconds"] == summary["projected"]["total_seconds"]
        assert row["wall_seconds"] == summary["wall_seconds"]
        assert row["ddp_bytes_per_this"] == ddp_sent / summary["bytes_sent_per_node"]
        assert float(csv_rows[name]["final_val_loss"]) == row["final_val_loss"]
        line = next(li for li in stdout.splitlines() if li.strip().startswith(f"{row['label']} "))
        assert f"{summary['final_val_loss']:.4f}" in line
        assert f"{summary['projected']['total_seconds']:.2f} s" in line
        # Steps to target: the first validation at or below it, read from metrics.csv.
        metrics = list(csv.DictReader((folder / name / "metrics.csv").open()))
        reached = [m for m in metrics if m["val_loss"] and int(m["step"]) > 0
                   and float(m["val_loss"]) <= document["target_loss"]]
        expected = int(reached[0]["step"]) if reached else None
        assert row["steps_to_target"] == expected
        if reached:
            assert row["projected_seconds_to_target"] == float(reached[0]["projected_seconds"])
            assert f"step {expected}, {row['projected_seconds_to_target']:.2f} s" in line
        else:
            assert "not reached" in line
    # DiLoCo(H=10) syncs 4 times in 40 steps, DDP all-reduces every step (its bucket also
    # holds one has-gradient flag per tensor, 4 of them): exactly 40 * (9610+4) / (4 * 9610).
    assert rows["diloco"]["ddp_bytes_per_this"] == pytest.approx(40 * 9614 / (4 * 9610))
    assert "10x fewer" in stdout and "1x" in stdout
    assert rows["ddp"]["steps_to_target"] == 40  # DDP reaches 1.05 x its own final loss at the end


def test_a_given_target_loss_changes_steps_to_target(compared, tmp_path: Path) -> None:
    folder, _ = compared
    runs = [load_run(folder / n) for n in STRATEGIES]
    shutil.copytree(folder, tmp_path / "copy")
    result = summarise(tmp_path / "copy", runs, target_loss=100.0)
    assert result.target_rule == "given (--target-loss)"
    assert all(r["steps_to_target"] == 10 for r in result.rows)  # the first validation is below 100


@pytest.mark.parametrize(("args", "message"), [
    (["--strategies", "ddp,nope"], "--strategies: unknown strategy 'nope'"),
    (["--strategies", "ddp,ddp"], "--strategies: 'ddp' is given twice"),
    (["--strategies", ","], "--strategies: give at least one strategy"),
    (["--set", "H=50"], "--set H: not a setting shared by every run; for one strategy's parameter "
                        "write STRATEGY.H=VALUE"),
    (["--set", "fedavg.H=2"], "--set fedavg.H: 'fedavg' is not among --strategies ddp,diloco,sparta"),
    (["--set", "diloco.Q=1"], "--set Q: not a setting or a parameter of strategy 'diloco'"),
    (["--set", "sparta.p=abc"], "error: strategy 'sparta': p must be int or float, got 'abc'"),
    (["--set", "run_id=x"], "--set run_id: a comparison sets this itself"),
    (["--set", "steps=0"], "ddp: --set steps must be >= 1, got 0"),
    (["--target-loss", "-1"], "--target-loss must be > 0, got -1.0"),
    (["--target-loss", "nan"], "--target-loss must be a finite number, got nan"),
    (["--cluster", "moon"], "ddp: unknown cluster 'moon'"),
    (["--nodes", "0"], "--nodes must be >= 1, got 0"),
    (["--task", "gpt"], "ddp: task 'gpt' needs a text file: --data FILE"),
])
def test_bad_options_are_one_line_exit_2_before_anything_runs(tmp_path: Path, args, message) -> None:
    result = runner.invoke(app, ["compare", "--out", str(tmp_path / "runs"), *args])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and result.output.startswith("error: "), result.output
    assert message in result.output, result.output
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_batch_too_large_for_a_shard_claims_nothing(tmp_path: Path) -> None:
    result = runner.invoke(app, ["compare", "--out", str(tmp_path), "--nodes", "64",
                                 "--set", "batch_size=64"])
    assert result.exit_code == 2 and "batch size 64 is larger than the shard" in result.output
    assert list(tmp_path.iterdir()) == []


def test_plan_of_the_defaults_is_digits_on_4_nodes_with_ddp_diloco_sparta() -> None:
    planned = plan(CompareSpec())
    assert [p.strategy for p in planned] == ["ddp", "diloco", "sparta"]
    assert {(p.spec.task, p.spec.nodes, p.spec.steps, p.spec.seed) for p in planned} == \
        {("digits", 4, 300, 0)}
    # compare's tuned digits defaults (COMPARE_DEFAULTS), on top of the task's own suggestions
    options = {p.strategy: p.instance.config() for p in planned}
    assert (options["diloco"]["H"], options["diloco"]["outer_momentum"]) == (25, 0.8)
    assert (options["sparta"]["p"], options["sparta"]["lr"]) == (0.005, 0.002)


def test_compare_takes_streaming_diloco_and_delayed_diloco_at_diloco_s_tuned_defaults() -> None:
    planned = plan(CompareSpec(strategies=["diloco", "streaming-diloco"],
                               overrides=["diloco.delay=1", "streaming-diloco.fragments=2"]))
    options = {p.strategy: p.instance.config() for p in planned}
    assert (options["diloco"]["H"], options["diloco"]["delay"]) == (25, 1)
    streaming = options["streaming-diloco"]
    assert (streaming["H"], streaming["lr"], streaming["outer_momentum"], streaming["fragments"]) == \
        (25, 0.002, 0.8, 2)


def test_plot_draws_any_finished_runs_and_names_a_bad_directory(compared, tmp_path: Path) -> None:
    folder, _ = compared
    result = runner.invoke(app, ["plot", str(folder / "ddp"), str(folder / "sparta"), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"val_loss_vs_{k}.{s}" for k in ("steps", "bytes", "time") for s in ("png", "svg"))
    assert "DiLoCo" not in (tmp_path / "val_loss_vs_steps.svg").read_text()
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.yaml").write_text("spec: {}\n")
    result = runner.invoke(app, ["plot", str(folder / "ddp"), str(tmp_path / "half")])
    assert result.exit_code == 2
    assert result.output == f"error: {tmp_path / 'half'}: not a finished run (no summary.json, metrics.csv)\n"
    result = runner.invoke(app, ["plot", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "missing: no such run directory" in result.output


def test_runs_lists_finished_runs_and_marks_unfinished_ones(compared, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    folder, _ = compared
    shutil.copytree(folder, tmp_path / folder.name)
    shutil.copytree(folder / "ddp", tmp_path / "20261123-100000-ddp-4n")
    shutil.copytree(folder / "ddp", tmp_path / "20261123-110000-ddp-4n.incomplete")
    (tmp_path / ".20261123-120000-ddp-4n.partial").mkdir()
    (tmp_path / "20261123-120000-ddp-4n.error.log").write_text("boom")
    listing = list_runs(tmp_path)
    assert sorted(str(r.path.relative_to(tmp_path)) for r in listing.finished) == sorted(
        ["20261123-100000-ddp-4n", *(f"{folder.name}/{n}" for n in STRATEGIES)])
    assert len(listing.unfinished) == 2
    # rich reads COLUMNS once, when the CLI's console is made (at import): a test worker with
    # no terminal gets 80 columns and the table cuts its cells short. 200, as a terminal would.
    from meshtrain.cli import main

    monkeypatch.setattr(main.console, "_width", 200)
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["runs", str(tmp_path)])
    assert result.exit_code == 0, result.output
    ddp = json.loads((folder / "ddp" / "summary.json").read_text())
    line = next(li for li in result.output.splitlines() if "20261123-100000-ddp-4n" in li)
    for cell in ("digits", "DDP", "40", f"{ddp['final_val_loss']:.4f}", f"{ddp['final_accuracy']:.4f}"):
        assert cell in line
    assert "unfinished" in next(li for li in result.output.splitlines() if ".incomplete" in li)
    assert "unfinished" in next(li for li in result.output.splitlines() if ".partial" in li)
    result = runner.invoke(app, ["runs", str(tmp_path / "nope")])
    assert result.exit_code == 2 and result.output == f"error: {tmp_path / 'nope'}: no such folder\n"


def test_runs_on_a_narrow_terminal_shows_every_run_whole(compared, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """At 80 columns the table's nine columns cannot show their words whole (rich cut every
    cell but the id to "D…"): each run is then its id on a line and its numbers below it."""
    folder, _ = compared
    shutil.copytree(folder, tmp_path / folder.name)
    from meshtrain.cli import main

    monkeypatch.setattr(main.console, "_width", 80)
    result = runner.invoke(app, ["runs", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    lines = result.output.splitlines()
    for name in STRATEGIES:
        summary = json.loads((folder / name / "summary.json").read_text())
        at = lines.index(f"{folder.name}/{name}")  # the id alone on its line, whole: copy it
        below = " ".join(" ".join(lines[at + 1 : at + 3]).split())  # the numbers, wrapped at 80 columns
        label = load_run(folder / name).label
        loss, accuracy = summary["final_val_loss"], summary["final_accuracy"]
        for cell in ("task digits", f"strategy {label}", "nodes 4", "steps 40", f"val loss {loss:.4f}",
                     f"accuracy {accuracy:.4f}"):
            assert cell in below, (name, cell, below)
    assert max(len(line.rstrip()) for line in lines) <= 80
    # Wide enough for the table, the table it is.
    monkeypatch.setattr(main.console, "_width", 200)
    wide = runner.invoke(app, ["runs", str(tmp_path)])
    assert "┃ id" in wide.output and "…" not in wide.output


def test_a_comparison_on_a_narrow_terminal_leaves_no_column_out(compared, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A label as long as SPARTA+DiLoCo's took the table past 80 columns, and rich left the
    last columns (reached target, wall here) out: each run is then a line of named cells."""
    folder, _ = compared
    document = json.loads((folder / "comparison.json").read_text())
    runs = [{**r, "label": "SPARTA+DiLoCo p=0.005 H=25"} if r["strategy"] == "sparta" else r
            for r in document["runs"]]
    from meshtrain.cli import main, research
    from meshtrain.cli.console import print_table

    monkeypatch.setattr(main.console, "_width", 80)
    table = research.comparison_table(runs, document["target_loss"], "a rule")
    print_table(table)
    out = capsys.readouterr().out
    assert "…" not in out and max(len(line.rstrip()) for line in out.splitlines()) <= 80
    text = " ".join(out.split())
    headers = [str(c.header) for c in table.columns]
    for row in zip(*(list(c.cells) for c in table.columns), strict=True):
        assert " ".join(f"{h} {c}" for h, c in zip(headers[1:], row[1:], strict=True)) in text, row
        for h, c in zip(headers[1:], row[1:], strict=True):  # each named cell whole on a line
            assert any(f"{h} {c}" in line for line in out.splitlines()), (h, c, out)
    assert len(list(table.columns[0].cells)) == len(runs)
    assert f"target val loss {document['target_loss']:.4f} (a rule)" in text


def test_a_comparison_takes_the_shared_settings_by_their_one_definition() -> None:
    # No mirror of RunSpec's fields: the shared settings are RunSpec's, by name.
    assert {f.name for f in dataclasses.fields(CompareSpec)} == {"strategies", "settings", "overrides",
                                                                 "target_loss"}
    planned = plan(CompareSpec(strategies=["ddp"], settings={"nodes": 2, "steps": 7, "batch_size": 8}))
    assert (planned[0].spec.nodes, planned[0].spec.steps, planned[0].spec.batch_size) == (2, 7, 8)
    with pytest.raises(ConfigError, match="unknown setting 'node'"):
        plan(CompareSpec(settings={"node": 2}))
    with pytest.raises(ConfigError, match="strategy: a comparison sets this itself"):
        plan(CompareSpec(settings={"strategy": "ddp"}))


FIRST_RUN_PROBE = """
import sys
import meshtrain.compare as compare
from meshtrain.compare import CompareSpec, run_comparison

real = compare.run_job
imported = []

def run_job(job):
    before = set(sys.modules)
    try:
        return real(job)
    finally:
        imported.append(sorted(set(sys.modules) - before))

compare.run_job = run_job
run_comparison(CompareSpec(strategies=["diloco", "ddp"], settings={"nodes": 2, "steps": 3,
               "progress": False, "out_dir": sys.argv[1]}))
heavy = [[m for m in run if m.split(".")[0] == "matplotlib" or m.startswith("torch._dynamo")]
         for run in imported]
print(heavy)
"""


def test_no_run_of_a_comparison_pays_the_processs_first_imports(tmp_path: Path) -> None:
    """The first run's "wall here" had been 2-10x the others' on a short comparison: the
    process's first optimizer step imports torch._dynamo (about 1 s) and its first plot
    matplotlib (0.4 s). A fresh interpreter, so nothing is imported beforehand."""
    proc = subprocess.run([sys.executable, "-c", FIRST_RUN_PROBE, str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[[], []]", proc.stdout


def test_plot_takes_a_comparison_folder_for_all_its_runs(compared, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`meshtrain plot runs/compare-...` had said "not a finished run": a folder of runs is
    all of them, a comparison folder or runs/ itself; an empty folder is one line."""
    folder, _ = compared
    from meshtrain import plots  # the command imports plot_runs from here when it runs

    drawn: list[list[str]] = []
    real = plots.plot_runs

    def recording(runs, out, target):  # noqa: ANN001, ANN202 - the real one's arguments
        drawn.append(sorted(run.path.name for run in runs))
        return real(runs, out, target)

    monkeypatch.setattr(plots, "plot_runs", recording)
    result = runner.invoke(app, ["plot", str(folder), "--out", str(tmp_path / "plots")])
    assert result.exit_code == 0, result.output
    assert drawn == [sorted(STRATEGIES)] and (tmp_path / "plots" / "val_loss_vs_steps.png").is_file()
    result = runner.invoke(app, ["plot", str(folder.parent), "--out", str(tmp_path / "plots")])
    assert result.exit_code == 0 and drawn[-1] == sorted(STRATEGIES), result.output  # runs/ itself
    (tmp_path / "empty").mkdir()
    result = runner.invoke(app, ["plot", str(tmp_path / "empty")])
    assert result.exit_code == 2
    message = f"error: {tmp_path / 'empty'}: not a finished run, nor a folder holding one"
    assert result.output.strip() == message
