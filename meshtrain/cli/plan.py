"""`meshtrain plan`: which strategy to run on a cluster, and why.

The command measures (or takes) one step's compute, counts the task model's trainable
parameters, and prints :func:`meshtrain.planning.recommend`'s table.
"""

from __future__ import annotations

import typer
from rich import box
from rich.table import Table

from meshtrain.cli.console import console, fail
from meshtrain.cluster import ClusterFileError, get_cluster
from meshtrain.planning import (
    COMM_BUDGET,
    SOURCES,
    Plan,
    Workload,
    measure_step_seconds,
    recommend,
    trainable_parameters,
)
from meshtrain.tasks import TaskError, TaskOptions, check_options, get_task


def plan(
    hosts: int = typer.Option(2, "--hosts", "-n", help="Hosts that will train (one rank each)."),
    cluster: str = typer.Option("gbe", "--cluster", help="Named cluster (meshtrain clusters) or a "
                                "cluster file from `meshtrain hosts bench`."),
    task: str = typer.Option("digits", "--task", "-t", help="Task whose model is planned for."),
    data: str = typer.Option(None, "--data", help="Data file or folder the task reads."),
    batch_size: int = typer.Option(None, "--batch-size", help="Samples per host per step "
                                   "(default: the task's)."),
    step_seconds: float = typer.Option(None, "--step-seconds", help="One step's compute on one host, "
                                       "if you know it (default: measured here, divided by the "
                                       "cluster's speed)."),
    budget: float = typer.Option(COMM_BUDGET, "--budget", help="Share of a step that may go to "
                                 "communication before a cheaper strategy is chosen."),
) -> None:
    """Recommend a strategy for a task on a cluster: projected time per step, the share spent
    communicating, the speedup over one host, and what the papers say about quality.

    Examples:

      meshtrain plan --hosts 2 --cluster wifi

      meshtrain plan --task gpt --data input.txt --hosts 3 --cluster runs/bench-cluster.yaml
    """
    if hosts < 1:
        raise fail(f"--hosts must be >= 1, got {hosts}")
    if not 0 < budget < 1:
        raise fail(f"--budget must be between 0 and 1 (a share of the step), got {budget!r}")
    if step_seconds is not None and not step_seconds > 0:
        raise fail(f"--step-seconds must be > 0, got {step_seconds!r}")
    try:
        chosen_cluster = get_cluster(cluster)
        chosen_task = get_task(task)
        options = check_options(chosen_task, {})
        bundle = chosen_task.build(TaskOptions(data=data, options=options))
    except (ValueError, ClusterFileError, TaskError) as exc:
        raise fail(str(exc)) from None
    batch = batch_size or int(chosen_task.defaults.get("batch_size", 32))
    if step_seconds is None:
        with console.status(f"timing a few {task} steps here (batch {batch})"):
            measured = measure_step_seconds(bundle.model, bundle.train_data, batch, bundle.collate_fn)
        step_seconds = measured / chosen_cluster.speed
    work = Workload(trainable_parameters(bundle.model), step_seconds, hosts)
    console.print(plan_table(recommend(work, chosen_cluster, budget)))
    console.print(SOURCES, style="dim", highlight=False)


def plan_table(result: Plan) -> Table:
    """Every candidate, the winner first and bold, with the reasons as the caption."""
    w = result.workload
    table = Table(title=f"{w.hosts} hosts on {result.cluster.name}: {w.trainable_parameters:,} trainable "
                        f"parameters, {w.step_seconds * 1e3:.1f} ms compute per step",
                  box=box.SIMPLE_HEAD, caption="\n".join(result.reasons), caption_justify="left")
    table.add_column("strategy")
    for column in ("per step", "communicating", "speedup"):
        table.add_column(column, justify="right")
    table.add_column("quality (literature)")
    rows = [result.choice, *(c for c in result.candidates if c is not result.choice)]
    for c in rows:
        table.add_row(c.label, f"{c.step_seconds * 1e3:.1f} ms", f"{c.comm_share:.1%}",
                      f"{c.speedup:.2f}x", c.quality, style="bold green" if c is result.choice else None)
    return table


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)

