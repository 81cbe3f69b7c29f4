"""The ``meshtrain`` command: simulate a cluster, list strategies, tasks and profiles."""

from __future__ import annotations

import atexit
import dataclasses
import gc
import inspect
import io
import time
import traceback
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from meshtrain import yaml12
from meshtrain.cli import dashboard as dashboard_cli
from meshtrain.cli import launch, research
from meshtrain.cli import plan as plan_cli
from meshtrain.cli import transcribe as transcribe_cli
from meshtrain.cli import up as up_cli
from meshtrain.cli.console import console, error_line, errors, fail, fail_on, print_table, terminal_text
from meshtrain.cli.flags import takes_settings
from meshtrain.cli.help_layout import keep_option_names_whole, reflow_command_help
from meshtrain.cluster import CLUSTERS
from meshtrain.config.environment import launched_rank
from meshtrain.config.profiles import list_profiles, load_profile
from meshtrain.config.resume import resume_conflict
from meshtrain.config.spec import ConfigError, RunSpec
from meshtrain.errors import MeshtrainError
from meshtrain.heartbeat import start_heartbeat
from meshtrain.interrupts import hand_back_ctrl_c, loading_quietly
from meshtrain.progress import human_bytes, human_seconds
from meshtrain.run_dir import atomic_write_text
from meshtrain.tasks import TASKS, get_task
from meshtrain.version import __version__


def _skip_the_final_collection() -> None:
    """Run at exit, before the interpreter tears itself down: move every object to gc's
    permanent generation, so the teardown's full collection does not walk torch's millions
    of objects (0.5-1 s of every command's exit, a launched rank's included). Objects
    still go when their last reference does; only cyclic garbage left at exit is not
    collected, as the process is ending. Registered here, by the command alone: a program
    that imports meshtrain as a library exits as it always did."""
    gc.freeze()


atexit.register(_skip_the_final_collection)  # runs before atexit handlers registered earlier
hand_back_ctrl_c()  # the imports are done: Ctrl-C is the commands' to handle again

keep_option_names_whole()
app = typer.Typer(
    help="Train with communication-efficient strategies on simulated nodes or real machines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

def _show_version(value: bool) -> None:
    if value:
        console.print(f"meshtrain {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                 help="Print meshtrain's version and exit."),
) -> None:
    """Train with communication-efficient strategies on simulated nodes or real machines."""


@app.command()
@takes_settings("simulate")
def simulate(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="On failure, print the failing "
                                 "node's full traceback (always written to <out>/<run-id>.error.log).",
                                 rich_help_panel="Output"),
    dashboard: bool = dashboard_cli.DASHBOARD_FLAG,
    settings_file: str = typer.Option(None, "--settings-file", hidden=True,
                                      help="A launched rank's resolved settings (meshtrain launch)."),
    **settings: Any,
) -> None:
    """Train N simulated nodes on this machine and report loss, bytes and time.

    With no arguments: 4 nodes train an MLP on scikit-learn's digits with DiLoCo.
    Inside a launched rank (RANK and WORLD_SIZE set) it trains that one rank instead.

    Exit codes: 0 done; 1 a node failed (its error is shown); 2 bad input (nothing ran);
    130 interrupted.

    Examples:

      meshtrain simulate --nodes 8 --strategy sparta --set p=0.01

      meshtrain simulate --strategy fedavg --set H=10 --set island_size=2

      meshtrain simulate --strategy diloco --cluster wifi   # projected on Wi-Fi

      meshtrain simulate --task gpt --data input.txt --set H=50

      meshtrain simulate --profile whisper-tiny-lora --nodes 2 --data recordings/

      meshtrain simulate --tensorboard --wandb demo   # also log there (extras)
    """
    # torch and the engine: here, not at the command's start (meshtrain --help needs neither).
    with loading_quietly():
        from meshtrain import checkpoint
        from meshtrain.build import build_run, resolve_run
        from meshtrain.engine.job import NodeFailed
        from meshtrain.engine.trainer import Trainer, run_job
    began = time.time()  # the progress bar's clock counts loading the model and data too
    launched = launched_rank() is not None
    set_: list[str] = list(settings.pop("set_"))
    profile, out, run_id, resume = (settings[k] for k in ("profile", "out_dir", "run_id", "resume"))
    if dashboard and not launched:
        dashboard_cli.require_extra("--dashboard")  # bad input (2), before anything is prepared
    if launched:  # beat from the start: a rank that stalls while loading data is noticed too
        start_heartbeat()
    if resume:
        try:
            found = checkpoint.find_latest(resume)
        except checkpoint.CheckpointError as exc:
            raise fail_on(exc) from None
        for note in found.skipped:
            errors.print(Text.assemble(("skipped a damaged checkpoint: ", "yellow"), terminal_text(note)),
                         soft_wrap=True)
        spec_file = found.folder.parent / checkpoint.SPEC
        if not spec_file.is_file():  # without it nothing says which run the state belongs to
            raise fail(f"--resume {resume}: {spec_file} is missing, so the run's settings are "
                       "unknown; resume from a <run-id>.checkpoints folder as the run wrote it")
        try:
            checkpointed = yaml12.read(spec_file)
        except (OSError, yaml12.YAMLError) as exc:
            problem = yaml12.problem(exc) if isinstance(exc, yaml12.YAMLError) else exc.strerror
            raise fail(f"--resume {resume}: {spec_file}: {problem}, so the run's settings are "
                       "unknown") from None
        if profile is None and settings_file is None:
            profile = str(spec_file)
        # <out>/<id>.checkpoints while a run goes, <out>/<id>/checkpoints once it finished.
        holder = found.folder.parent
        run_folder = holder.parent if holder.name == "checkpoints" else holder.parent / found.run_id
        out = out or str(run_folder.parent)
        target = Path(out) / (run_id or found.run_id)
        if (target / "summary.json").is_file():  # it would train again into a finished run
            raise fail(f"--resume {resume}: run {found.run_id} already finished ({target}); to "
                       "train it further, give --steps above its steps and a new --run-id or --out")
        console.print(f"resuming run {found.run_id} after step {found.step} ({found.folder})",
                      highlight=False)
    flags = {**settings, "profile": profile, "out_dir": out, "settings_file": settings_file,
             "fail": settings["fail"] or None, "straggler": settings["straggler"] or None}
    # Everything is checked before the first step: up to here, an error is bad input (2).
    try:
        if resume:  # the settings must be the checkpointed run's, but for what may change
            conflict = resume_conflict(checkpointed, resolve_run(flags, set_, launched)[0], found.step)
            if conflict:
                raise fail(f"--resume {resume}: {conflict}")
        spec, bundle, strat = build_run(flags, set_, launched)
        uneven = getattr(strat, "uneven_islands", lambda nodes: None)(spec.nodes)
        if uneven:
            errors.print(f"note: {uneven}", highlight=False, soft_wrap=True, markup=False)
        if "plan" in spec.extra_config:  # --strategy auto: say what was chosen, and why
            plan = spec.extra_config["plan"]
            chosen = ", ".join(f"{k}={v}" for k, v in plan["strategy_options"].items())
            console.print(f"strategy auto: {spec.strategy}{f' ({chosen})' if chosen else ''} on "
                          f"{plan['cluster']}; {'; '.join(plan['reasons'])}", highlight=False, markup=False)
            for warning in plan.get("warnings", []):  # a noisy compute probe
                errors.print(f"warning: {warning}", highlight=False, soft_wrap=True, markup=False)
        config = spec.train_config(extra_config={"spec": spec.to_dict(), **spec.extra_config})
        trainer = Trainer(bundle.model, bundle.train_data, bundle.val_data, bundle.collate_fn)
        job = trainer.prepare(strat, config=config, began=began)
    except (ValueError, FileExistsError) as exc:  # ConfigError, TaskError, SettingError
        raise fail(str(exc)) from None
    except KeyboardInterrupt:  # loading a model or data can take a while
        errors.print("interrupted before training began: nothing was written", style="bold red")
        raise typer.Exit(130) from None
    # From here on, an error is a failure of the run (1), never "bad input".
    try:
        with dashboard_cli.live_dashboard(dashboard and not launched, "simulate", job.run_id,
                                          [f"node {r}" for r in range(spec.nodes)],
                                          {"strategy": spec.strategy, "task": spec.task}):
            result = run_job(job)
    except NodeFailed as exc:
        _report_failure(exc, job, verbose)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        errors.print("interrupted: the run was stopped; no run directory was written", style="bold red")
        _resume_hint(job)
        raise typer.Exit(130) from None
    except Exception as exc:  # noqa: BLE001 - the run failed here, after starting
        _report_failure(exc, job, verbose)
        raise typer.Exit(1) from None
    if result.run_dir is not None:
        print_summary(result.summary, result.run_dir)


def _report_failure(exc: BaseException, job: Any, verbose: bool) -> None:
    """One line for the failure; the full traceback under --verbose and in the error log."""
    # meshtrain's own errors are one line that says what failed ("node 1 failed: ..."); anything
    # else is named by its type.
    message = str(exc) if isinstance(exc, MeshtrainError) else f"{type(exc).__name__}: {exc}"
    errors.print(error_line(message), soft_wrap=True)
    if verbose:
        node_traceback = getattr(exc, "traceback", None)
        if node_traceback:
            errors.print(node_traceback, highlight=False, soft_wrap=True, markup=False)
        else:
            errors.print("".join(traceback.format_exception(exc)), highlight=False, soft_wrap=True,
                         markup=False)
    if job.run_dir is not None and job.run_dir.error_log.exists():
        errors.print(f"full traceback: {job.run_dir.error_log}", highlight=False, soft_wrap=True)
    _resume_hint(job)


def _resume_hint(job: Any) -> None:
    """After a stop: where the last checkpoint is and the command that continues from it."""
    if job.checkpoints is not None and any(job.checkpoints.glob("step-*")):
        latest = sorted(job.checkpoints.glob("step-*"))[-1]
        errors.print(f"last checkpoint: {latest}\nresume with: meshtrain simulate --resume "
                     f"{job.checkpoints}", highlight=False, soft_wrap=True)


def print_summary(summary: dict[str, Any], run_dir: Path) -> None:
    """The results table at the end of a run."""
    nodes = summary["nodes"]
    table = Table(title=f"{summary['strategy']} on {nodes} node{'' if nodes == 1 else 's'}",
                  show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("steps", str(summary["steps"]))
    table.add_row("final train loss", f"{summary['final_train_loss']:.4f}")
    initial = summary.get("initial") or {}

    def before_after(value: float, before: float | None) -> str:
        return f"{value:.4f}" if before is None else f"{before:.4f} at step 0 -> {value:.4f}"

    if summary.get("final_val_loss") is not None:
        table.add_row("val loss", before_after(summary["final_val_loss"], initial.get("val_loss")))
    for key, value in summary.items():
        if key.startswith("final_") and key not in ("final_train_loss", "final_val_loss"):
            metric = key.removeprefix("final_")
            table.add_row(metric.replace("_", " "), before_after(value, initial.get(f"val_{metric}")))
    table.add_row("sent per node", human_bytes(summary["bytes_sent_per_node"]))
    if summary.get("peak_bytes_sent_per_sync") is not None:
        table.add_row("peak per sync", human_bytes(summary["peak_bytes_sent_per_sync"]))
    table.add_row("trainable parameters", f"{summary['trainable_parameters']:,}")
    table.add_row("wall clock here", f"{summary['wall_seconds']:.1f} s")
    faults = summary.get("faults") or {}
    for failure in faults.get("failures", []):
        table.add_row(f"node {failure['node']}", f"left after step {failure['step']} (--fail)")
    projected = summary.get("projected")
    if projected:
        table.add_row(
            f"projected on {projected['cluster']}",
            f"{human_seconds(projected['total_seconds'])} (compute "
            f"{human_seconds(projected['compute_seconds'])} + communication "
            f"{human_seconds(projected['communication_seconds'])}"
            + (f" + waiting for the slowest host {human_seconds(wait)})"
               if (wait := projected.get("sync_wait_seconds")) is not None else ")"),
        )
        if summary.get("runtime") == "launched" and "measured_communication_seconds" in projected:
            # Over the real link, beside the model's figure: a user sees when the model is off.
            table.add_row("communication measured",
                          f"{human_seconds(projected['measured_communication_seconds'])} "
                          f"(projected {human_seconds(projected['communication_seconds'])})")
        if "idle_seconds" in projected:
            slow = ", ".join(f"node {s['node']} x{s['slowdown']:g}" for s in faults.get("stragglers", []))
            table.add_row("waiting for stragglers",
                          f"{projected['idle_seconds']:.2f} node-seconds idle ({slow})")
    shares = summary.get("balance")
    if shares:  # --balance: each node's samples per step
        table.add_row("balance (samples/step)", ", ".join(
            f"node {n['node']} {n['batch_size']} ({n['share']:.0%})" for n in shares["nodes"]))
    console.print(table)
    console.print(f"run directory: [bold]{run_dir}[/]", highlight=False)
    # The run's log.txt ends with the same table, as text.
    recorder = Console(record=True, width=100, file=io.StringIO())
    recorder.print(table)
    log = run_dir / "log.txt"
    if log.is_file():
        atomic_write_text(log, log.read_text() + recorder.export_text())


@app.command("strategies")
def list_strategies() -> None:
    """List the strategies with their parameters and defaults."""
    with loading_quietly():
        from meshtrain.strategies import STRATEGIES, Strategy
    shared = [n for n in Strategy.parameters() if n not in ("optim", "lr")]
    table = Table(
        title="strategies (set parameters with --set NAME=VALUE)",
        caption="Every strategy also takes: " + ", ".join(shared) + ".",
    )
    table.add_column("name", style="bold")
    table.add_column("what it does")
    table.add_column("parameters")
    for name, cls in STRATEGIES.items():
        params = ", ".join(
            f"{n}={_show_default(p.default)}" for n, p in cls.parameters().items() if n not in shared
        )
        doc = (inspect.getdoc(cls) or "").splitlines()[0].replace("``", "").replace("`", "")
        table.add_row(name, doc, params)
    console.print(table)


def _show_default(value: Any) -> str:
    if value is inspect.Parameter.empty:
        return "(required)"
    return repr(value) if isinstance(value, str) else str(value)


@app.command("settings")
def list_settings() -> None:
    """List every run setting with its default: flags, profiles and --set all take these."""
    table = Table(title="settings (a profile key, --set NAME=VALUE, or the flag shown)")
    # Long words (flags, paths) fold rather than being cut: at 80 columns every cell is whole.
    table.add_column("name", style="bold", overflow="fold")
    table.add_column("flag (commands)", overflow="fold")
    table.add_column("default", overflow="fold")
    table.add_column("what it sets", overflow="fold")
    for f in dataclasses.fields(RunSpec):
        if f.name in ("extra_config",):
            continue
        default = f.default_factory() if callable(f.default_factory) else f.default
        flag = f.metadata.get("flag")
        shown = f"{', '.join(flag.names)} ({', '.join(flag.commands)})" if flag else "-"
        table.add_row(f.name, shown, escape(_show_default(default)), escape(f.metadata.get("help", "")))
    console.print(table)


@app.command("clusters")
def list_clusters() -> None:
    """List the named clusters that `simulate --cluster` projects wall-clock onto."""
    table = Table(title="clusters (alpha-beta model: latency per message + bytes / bandwidth)")
    table.add_column("name", style="bold")
    table.add_column("what it models")
    table.add_column("bandwidth", justify="right")
    table.add_column("latency", justify="right")
    for c in CLUSTERS.values():
        shared = " shared" if c.shared_medium else ""
        table.add_row(c.name, c.description, f"{human_bytes(c.bandwidth)}/s{shared}",
                      f"{c.latency * 1e3:g} ms")
    console.print(table)


@app.command("tasks")
def list_tasks() -> None:
    """List the built-in tasks and their options."""
    table = Table(title="tasks (options: --set task_options.NAME=VALUE)")
    table.add_column("name", style="bold")
    table.add_column("what it trains")
    table.add_column("options")
    for entry in TASKS.values():
        try:
            with loading_quietly():  # the task's module, and torch with it
                options = ", ".join(f"{k}={v}" for k, v in get_task(entry.name).options.items())
        except ImportError as exc:  # an optional dependency is missing
            options = f"(unavailable: {exc})"
        table.add_row(entry.name, entry.description, options)
    console.print(table)


@app.command("profiles")
def list_profile_files() -> None:
    """List the profiles (ready-made runs: meshtrain simulate --profile NAME)."""
    table = Table(title="profiles")
    table.add_column("name", style="bold", no_wrap=True)  # what --profile takes: never cut
    table.add_column("description")
    table.add_column("file")
    for name, path in list_profiles().items():
        try:
            description = load_profile(str(path)).get("description", "")
        except ConfigError as exc:
            description = f"(invalid: {exc})"
        table.add_row(name, description, str(path))
    print_table(table)


launch.register(app)
research.register(app)
dashboard_cli.register(app)
plan_cli.register(app)
transcribe_cli.register(app)
up_cli.register(app)  # after launch: up runs the launch command as registered
reflow_command_help(app)  # every command registered: its help wraps at the terminal's edge


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
