"""`meshtrain compare`, `meshtrain plot` and `meshtrain runs`: the research workflow.

The commands parse and print; the work is in :mod:`meshtrain.compare`,
:mod:`meshtrain.plots` and :mod:`meshtrain.runs`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich import box
from rich.table import Table

from meshtrain.cli.console import console, fail, fail_on, print_table
from meshtrain.cli.flags import checked_options, takes_options, takes_settings
from meshtrain.config.research import COMPARE, PLOT, CompareSettings, PlotSettings
from meshtrain.config.settings import check_flag
from meshtrain.config.spec import RunSpec
from meshtrain.errors import SettingError
from meshtrain.interrupts import loading_quietly
from meshtrain.progress import human_bytes

# These load torch (the strategies, the engine): each command imports them where it runs,
# so the commands build, and --help answers, without torch.
if TYPE_CHECKING:
    from meshtrain.runs import FinishedRun


@takes_settings(COMPARE)
@takes_options(CompareSettings, COMPARE)
def compare(**given: Any) -> None:
    """Run several strategies under identical conditions and compare loss, bytes and time.

    Same seed (initial weights, data order), task, nodes and step budget for every run;
    each run is a normal run directory in runs/compare-<time>/<strategy>/, next to
    comparison.json, comparison.csv and the plots (PNG and SVG).

    Examples:

      meshtrain compare

      meshtrain compare --strategies ddp,diloco,sparta,fedavg,demo --cluster wifi

      meshtrain compare --set diloco.H=50 --set sparta.p=0.001 --set lr=0.01
    """
    own = {f.name: given.pop(f.name) for f in dataclasses.fields(CompareSettings)}  # the rest: settings
    how = checked_options(CompareSettings, own)
    overrides = list(given.pop("set_"))
    settings = {k: v for k, v in given.items() if v is not None}  # the training settings given
    try:  # each by its setting's own rule, the error naming the flag
        for key, value in settings.items():
            check_flag(RunSpec, key, value)
    except SettingError as exc:
        raise fail(str(exc)) from None
    with loading_quietly():
        from meshtrain.compare import CompareSpec, plan, run_comparison
    spec = CompareSpec(strategies=[s.strip() for s in how.strategies.split(",") if s.strip()],
                       settings=settings, overrides=overrides, target_loss=how.target_loss)
    try:
        planned = plan(spec)
    except ValueError as exc:
        raise fail(str(exc)) from None
    try:
        result = run_comparison(spec, planned, notify=lambda line: console.print(line, highlight=False))
    except ValueError as exc:  # a run directory that could not be claimed: nothing trained
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        raise fail("interrupted: the runs finished so far are kept in the comparison folder", 130) \
            from None
    except Exception as exc:  # noqa: BLE001 - a run failed after it started
        raise fail(f"{type(exc).__name__}: {exc}", 1) from None
    print_table(comparison_table(result.rows, result.target_loss, result.target_rule))
    console.print(f"comparison folder: [bold]{result.folder}[/] (comparison.json, comparison.csv, "
                  f"{', '.join(p.name for p in result.plots if p.suffix == '.png')})", highlight=False)


def comparison_table(rows: list[dict[str, Any]], target: float, rule: str) -> Table:
    """The table `meshtrain compare` prints, one row per run."""
    clusters = sorted({str(r["cluster"]) for r in rows})
    compute = {r.get("step_seconds") for r in rows}
    (step_seconds,) = compute if len(compute) == 1 else (None,)
    per_step = f" at {step_seconds * 1e3:.2f} ms of compute per step" if step_seconds is not None else ""
    table = Table(title=f"{len(rows)} strategies: same seed, data, nodes and steps", box=box.SIMPLE_HEAD,
                  pad_edge=False, collapse_padding=True,  # 80 columns for most labels (else print_table)
                  caption=f"target val loss {target:.4f} ({rule}); projected on "
                          f"{', '.join(clusters)}{per_step}", caption_justify="left")
    metrics = sorted({r["metric"] for r in rows if r["metric"]})
    cells = []
    for r in rows:
        metric = "-" if not r["metric"] else f"{r['final_metric']:.4f}" if len(metrics) == 1 \
            else f"{r['metric']} {r['final_metric']:.4f}"
        reached = "not reached" if r["steps_to_target"] is None else \
            f"step {r['steps_to_target']}, {_num(r['projected_seconds_to_target'], '.2f', ' s')}"
        cells.append([
            r["label"], _num(r["final_val_loss"], ".4f"), metric, human_bytes(r["bytes_sent_per_node"]),
            _ratio(r["ddp_bytes_per_this"], r["strategy"]), _num(r["projected_seconds"], ".2f", " s"),
            reached, _num(r["wall_seconds"], ".1f", " s"),
        ])
    names = ("strategy", "val loss", metrics[0] if len(metrics) == 1 else "metric", "sent/node", "vs DDP",
             "projected", "reached target", "wall here")
    for i, name in enumerate(names):
        # Numbers are never cut short; on a narrow terminal the headers wrap instead.
        table.add_column(name, justify="left" if i == 0 else "right",
                         min_width=max(len(row[i]) for row in cells))
    for row in cells:
        table.add_row(*row)
    return table


def _num(value: float | None, fmt: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{unit}"


def _ratio(ratio: float | None, strategy: str) -> str:
    """DDP's bytes over this run's: ``25x fewer`` (this run sent 1/25 of DDP's bytes)."""
    if ratio is None:
        return "-"
    if strategy == "ddp" or abs(ratio - 1) < 0.005:
        return "1x"
    if ratio > 1:
        return f"{ratio:.0f}x fewer" if ratio >= 10 else f"{ratio:.1f}x fewer"
    return f"{1 / ratio:.1f}x more"


@takes_options(PlotSettings, PLOT)
def plot(run_dirs: list[Path] = typer.Argument(..., metavar="RUN_DIR",
                                               help="Finished run directories to draw, or folders of them "
                                                    "(a comparison folder: all its runs)."),
         **options: Any) -> None:
    """Plot finished runs: val loss against steps, bytes sent per node and projected time."""
    how = checked_options(PlotSettings, options)
    out = Path(how.out)
    with loading_quietly():
        from meshtrain.plots import plot_runs
        from meshtrain.runs import RunError, load_runs
    try:
        runs = [run for d in run_dirs for run in load_runs(d)]
    except RunError as exc:
        raise fail_on(exc) from None
    if not any(run.validation() for run in runs):
        raise fail(f"{run_dirs[0]}: these runs have no validation loss to plot")
    try:
        written = plot_runs(runs, out, how.target_loss)
    except OSError as exc:
        raise fail(f"--out {out}: cannot write the plots ({exc.strerror or exc})", 1) from None
    for path in written:
        console.print(str(path), highlight=False)


def runs(
    folder: Path = typer.Argument(Path("runs"), metavar="FOLDER", help="Folder of run directories."),
) -> None:
    """List the finished runs in a folder (comparison folders included)."""
    with loading_quietly():
        from meshtrain.runs import RunError, list_runs
    try:
        listing = list_runs(folder)
    except RunError as exc:
        raise fail_on(exc) from None
    if not listing.finished and not listing.unfinished:
        console.print(f"no runs in {folder}", highlight=False)
        return
    table = Table(title=f"finished runs in {folder}")
    names = sorted({m[0] for m in (r.metric() for r in listing.finished) if m})
    metric_header = names[0] if len(names) == 1 else "metric"
    for name in ("id", "task", "strategy", "nodes", "steps", "val loss", metric_header, "sent/node", "wall"):
        # The id is what you type next (meshtrain plot runs/ID): never cut short.
        table.add_column(name, justify="left" if name in ("id", "task", "strategy") else "right",
                         no_wrap=name == "id")
    for run in listing.finished:
        table.add_row(*_run_cells(run, folder, with_name=len(names) > 1))
    if listing.finished:
        print_table(table)
    for path, why in listing.unfinished:
        console.print(f"[yellow]unfinished:[/] {path.relative_to(folder)} ({why})", highlight=False)


def _run_cells(run: FinishedRun, folder: Path, with_name: bool) -> list[str]:
    s = run.summary
    metric = run.metric()
    shown = "-" if not metric else f"{metric[0]} {metric[1]:.4f}" if with_name else f"{metric[1]:.4f}"
    return [
        str(run.path.relative_to(folder)), run.task, run.label, str(s.get("nodes", "?")),
        str(s.get("steps", "?")), _num(s.get("final_val_loss"), ".4f"),
        shown,
        human_bytes(s.get("bytes_sent_per_node") or 0), _num(s.get("wall_seconds"), ".1f", " s"),
    ]


def register(app: typer.Typer) -> None:
    """Add ``compare``, ``plot`` and ``runs`` to the ``meshtrain`` app."""
    app.command("compare")(compare)
    app.command("plot")(plot)
    app.command("runs")(runs)
