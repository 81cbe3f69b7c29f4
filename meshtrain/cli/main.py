"""The ``meshtrain`` command: simulate a cluster, list strategies, tasks and profiles."""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from meshtrain.cluster import CLUSTERS
from meshtrain.config import (
    ConfigError,
    RunSpec,
    build_strategy,
    list_profiles,
    load_profile,
    parse_set,
    resolve_spec,
    strategy_class,
)
from meshtrain.devices import resolve_device
from meshtrain.progress import human_bytes
from meshtrain.strategies import STRATEGIES, Strategy
from meshtrain.tasks import TASKS, TaskOptions, check_options, get_task

app = typer.Typer(
    help="Train with communication-efficient strategies on simulated nodes or real machines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
errors = Console(stderr=True)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print one clear line (no traceback) and return the exit to raise."""
    errors.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


# Flags shared by `simulate` and `launch` (the launcher forwards them to every rank).
TRAINING_FLAGS = dict(
    profile=typer.Option(None, "--profile", "-p", help="Profile name (profiles/NAME.yaml) or path."),
    strategy=typer.Option(None, "--strategy", "-s", help="Strategy: " + ", ".join(STRATEGIES) + "."),
    task=typer.Option(None, "--task", "-t", help="Task: " + ", ".join(TASKS) + "."),
    data=typer.Option(None, "--data", help="Data file or folder the task reads."),
    steps=typer.Option(None, "--steps", help="Training steps (each node takes one batch a step)."),
    batch_size=typer.Option(None, "--batch-size", "-b", help="Batch size per node."),
    microbatch_size=typer.Option(None, "--microbatch-size", help="Accumulate gradients in pieces."),
    lr=typer.Option(None, "--lr", help="Learning rate (DiLoCo: the inner optimizer's)."),
    device=typer.Option(None, "--device", help="cpu, cuda, mps or auto."),
    seed=typer.Option(None, "--seed", help="Seed of weights, data order and shared choices."),
    val_interval=typer.Option(None, "--val-interval", help="Evaluate every N steps."),
    set_=typer.Option([], "--set", help="Override any setting: key=value (H=50, task_options.arch=cnn)."),
)


def build_run(
    flags: dict[str, Any], overrides: list[str], launched: bool
) -> tuple[RunSpec, Any, Any]:
    """Resolve settings layers into a spec, then build the task and the strategy."""
    profile = load_profile(flags.pop("profile")) if flags.get("profile") else {}
    task_name = flags.get("task") or profile.get("task") or RunSpec.task
    strategy_name = flags.get("strategy") or profile.get("strategy") or RunSpec.strategy
    task = get_task(task_name)
    strategy_class(strategy_name)
    defaults = {**task.defaults, "strategy_options": task.strategy_defaults.get(strategy_name, {})}
    spec = resolve_spec([defaults, profile, flags, parse_set(overrides, strategy_name)])
    if launched:
        spec.nodes = int(os.environ["WORLD_SIZE"])
    try:
        resolve_device(spec.device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    bundle = task.build(TaskOptions(spec.data, spec.seed, check_options(task, spec.task_options)))
    strategy = build_strategy(spec)
    return spec, bundle, strategy


@app.command()
def simulate(
    nodes: int = typer.Option(None, "--nodes", "-n", help="Number of simulated nodes (default 4)."),
    runtime: str = typer.Option(None, "--runtime", help="threads (fast) or processes (gloo)."),
    out: Path = typer.Option(Path("runs"), "--out", help="Where run directories go."),
    run_id: str = typer.Option(None, "--run-id", help="Name of the run directory."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
    cluster: str = typer.Option("gbe", "--cluster", help="Project wall-clock on this named cluster "
                                "(`meshtrain clusters` lists them)."),
    step_seconds: float = typer.Option(None, "--step-seconds", help="A node's compute per step on "
                                       "that cluster, if known (default: measured here)."),
    profile: str = TRAINING_FLAGS["profile"],
    strategy: str = TRAINING_FLAGS["strategy"],
    task: str = TRAINING_FLAGS["task"],
    data: str = TRAINING_FLAGS["data"],
    steps: int = TRAINING_FLAGS["steps"],
    batch_size: int = TRAINING_FLAGS["batch_size"],
    microbatch_size: int = TRAINING_FLAGS["microbatch_size"],
    lr: float = TRAINING_FLAGS["lr"],
    device: str = TRAINING_FLAGS["device"],
    seed: int = TRAINING_FLAGS["seed"],
    val_interval: int = TRAINING_FLAGS["val_interval"],
    set_: list[str] = TRAINING_FLAGS["set_"],
) -> None:
    """Train N simulated nodes on this machine and report loss, bytes and time.

    With no arguments: 4 nodes train an MLP on scikit-learn's digits with DiLoCo.
    Inside a launched rank (RANK and WORLD_SIZE set) it trains that one rank instead.

    Examples:

      meshtrain simulate --nodes 8 --strategy sparta --set p=0.01

      meshtrain simulate --strategy fedavg --set H=10 --set island_size=2 --cluster wifi

      meshtrain simulate --task gpt --data input.txt --set H=50

      meshtrain simulate --profile whisper-tiny-lora --nodes 2 --data recordings/
    """
    from meshtrain import NodeFailed, Trainer

    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    flags = dict(profile=profile, strategy=strategy, task=task, data=data, steps=steps,
                 batch_size=batch_size, microbatch_size=microbatch_size, lr=lr, device=device,
                 seed=seed, val_interval=val_interval, nodes=nodes, runtime=runtime)
    try:
        spec, bundle, strat = build_run(flags, set_, launched)
        result = Trainer(bundle.model, bundle.train_data, bundle.val_data, bundle.collate_fn).fit(
            strategy=strat,
            nodes=None if launched else spec.nodes,
            max_steps=spec.steps,
            epochs=spec.epochs,
            batch_size=spec.batch_size,
            microbatch_size=spec.microbatch_size,
            seed=spec.seed,
            device=spec.device,
            runtime=spec.runtime,
            shuffle=spec.shuffle,
            val_interval=spec.val_interval,
            val_size=spec.val_size,
            out_dir=out,
            run_id=run_id,
            progress=progress,
            cluster=cluster,
            step_seconds=step_seconds,
            extra_config={"spec": spec.to_dict()},
        )
    except NodeFailed as exc:
        raise fail(str(exc), code=1) from None
    except (ValueError, FileExistsError) as exc:  # ConfigError, TaskError, rejected settings
        raise fail(str(exc)) from None
    if result.run_dir is not None:
        print_summary(result.summary, result.run_dir)


def print_summary(summary: dict[str, Any], run_dir: Path) -> None:
    """The results table at the end of a run."""
    table = Table(title=f"{summary['strategy']} on {summary['nodes']} nodes", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("steps", str(summary["steps"]))
    table.add_row("final train loss", f"{summary['final_train_loss']:.4f}")
    if summary.get("final_val_loss") is not None:
        table.add_row("final val loss", f"{summary['final_val_loss']:.4f}")
    for key, value in summary.items():
        if key.startswith("final_") and key not in ("final_train_loss", "final_val_loss"):
            table.add_row(key.removeprefix("final_").replace("_", " "), f"{value:.4f}")
    table.add_row("sent per node", human_bytes(summary["bytes_sent_per_node"]))
    table.add_row("trainable parameters", f"{summary['trainable_parameters']:,}")
    table.add_row("wall clock here", f"{summary['wall_seconds']:.1f} s")
    projected = summary.get("projected")
    if projected:
        table.add_row(
            f"projected on {projected['cluster']}",
            f"{projected['total_seconds']:.2f} s (compute {projected['compute_seconds']:.2f} s"
            f" + communication {projected['communication_seconds']:.2f} s)",
        )
    console.print(table)
    console.print(f"run directory: [bold]{run_dir}[/]", highlight=False)


@app.command("strategies")
def list_strategies() -> None:
    """List the strategies with their parameters and defaults."""
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
        doc = (inspect.getdoc(cls) or "").splitlines()[0]
        table.add_row(name, doc, params)
    console.print(table)


def _show_default(value: Any) -> str:
    if value is inspect.Parameter.empty:
        return "(required)"
    return repr(value) if isinstance(value, str) else str(value)


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
            options = ", ".join(f"{k}={v}" for k, v in get_task(entry.name).options.items())
        except ImportError as exc:  # an optional dependency is missing
            options = f"(unavailable: {exc})"
        table.add_row(entry.name, entry.description, options)
    console.print(table)


@app.command("profiles")
def list_profile_files() -> None:
    """List the profiles (ready-made runs: meshtrain simulate --profile NAME)."""
    table = Table(title="profiles")
    table.add_column("name", style="bold")
    table.add_column("description")
    table.add_column("file")
    for name, path in list_profiles().items():
        try:
            description = load_profile(str(path)).get("description", "")
        except ConfigError as exc:
            description = f"(invalid: {exc})"
        table.add_row(name, description, str(path))
    console.print(table)


from meshtrain.cli import launch as launch_cli  # noqa: E402 - after TRAINING_FLAGS, which it reuses

launch_cli.register(app)


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
