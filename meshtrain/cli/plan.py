"""`meshtrain plan`: which strategy to run on a cluster, and why.

The command measures (or takes) one step's compute, counts the task model's trainable
parameters, and prints :func:`meshtrain.planning.recommend`'s table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer
from rich import box
from rich.table import Table

from meshtrain.cli.console import console, fail
from meshtrain.cli.flags import checked_options, takes_options
from meshtrain.cluster import ClusterFileError, get_cluster
from meshtrain.config.environment import resolve_threads
from meshtrain.config.plan import PLAN, PlanSettings
from meshtrain.interrupts import loading_quietly
from meshtrain.progress import human_bytes
from meshtrain.tasks import TaskError, TaskOptions, check_options, get_task

if TYPE_CHECKING:
    from meshtrain.planning import Plan


@takes_options(PlanSettings, PLAN)
def plan(**options: Any) -> None:
    """Recommend a strategy for a task on a cluster: projected time per step, the share spent
    communicating, the speedup over one host, and what the papers say about quality.

    Examples:

      meshtrain plan --hosts 2 --cluster wifi

      meshtrain plan --task gpt --data input.txt --hosts 3 --cluster wifi

      meshtrain plan --hosts 3 --cluster clusters/lab.yaml   # from hosts bench
    """
    how = checked_options(PlanSettings, options)
    with loading_quietly():  # torch: here, not at the command's start (meshtrain --help needs none)
        from meshtrain.planning import SOURCES, Workload, probe_compute, recommend, trainable_parameters
    try:
        cluster = get_cluster(how.cluster)
        task = get_task(how.task)
        bundle = task.build(TaskOptions(data=how.data, options=check_options(task, {})))
    except (ValueError, ClusterFileError, TaskError) as exc:
        raise fail(str(exc)) from None
    batch = how.batch_size or int(task.defaults.get("batch_size", 32))
    step_seconds = how.step_seconds
    if step_seconds is None:
        # As a host's rank will compute: its threads (MESHTRAIN_THREADS, else the cores per rank).
        threads = resolve_threads(None, "launched")
        with console.status(f"timing a few {how.task} steps here (batch {batch}, {threads} threads)"):
            probe = probe_compute(bundle.model, bundle.train_data, batch, bundle.collate_fn, threads=threads)
        step_seconds = probe.seconds / cluster.speed
        console.print(f"compute probe: {probe.seconds * 1e3:.3g} ms a step with {threads} torch "
                      f"thread{'s' if threads != 1 else ''}, {len(probe.round_seconds)} rounds, spread "
                      f"{probe.spread:.0%}", highlight=False)
        if probe.warning():
            console.print(f"warning: {probe.warning()}", style="yellow", highlight=False, markup=False)
    work = Workload(trainable_parameters(bundle.model), step_seconds, how.hosts)
    console.print(plan_table(recommend(work, cluster, how.budget)))
    console.print(SOURCES, style="dim", highlight=False)


def plan_table(result: Plan) -> Table:
    """Every candidate, the winner first and bold, with the reasons as the caption."""
    w = result.workload
    table = Table(title=f"{w.hosts} hosts on {result.cluster.name}: {w.trainable_parameters:,} trainable "
                        f"parameters, {w.step_seconds * 1e3:.1f} ms compute per step",
                  box=box.SIMPLE_HEAD, caption="\n".join(result.reasons), caption_justify="left")
    table.add_column("strategy")
    for column in ("per step", "communicating", "peak per sync", "speedup"):
        table.add_column(column, justify="right")
    table.add_column("quality (literature)")
    rows = [result.choice, *(c for c in result.candidates if c is not result.choice)]
    for c in rows:
        table.add_row(c.label, f"{c.step_seconds * 1e3:.1f} ms", f"{c.comm_share:.1%}",
                      human_bytes(c.peak_bytes) if c.peak_bytes else "-", f"{c.speedup:.2f}x",
                      c.quality, style="bold green" if c is result.choice else None)
    return table


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)

