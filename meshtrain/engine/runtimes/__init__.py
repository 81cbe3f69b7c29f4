"""Where the nodes of a run live: threads in this process, local processes, the rank this
process already is (launched by ``meshtrain launch`` or torchrun), or one vectorised
computation holding every node (vmap)."""

from __future__ import annotations

from meshtrain.engine.job import FitResult, NodeJob
from meshtrain.engine.runtimes.launched import run_launched_rank
from meshtrain.engine.runtimes.processes import run_processes
from meshtrain.engine.runtimes.threads import run_threads
from meshtrain.engine.runtimes.vmap import run_vmap


def run(job: NodeJob) -> FitResult:
    """Run ``job`` on the runtime its config names."""
    runtime = job.config.runtime
    if runtime == "threads":
        return run_threads(job)
    if runtime == "processes":
        return run_processes(job)
    if runtime == "launched":
        return run_launched_rank(job)
    if runtime == "vmap":
        return run_vmap(job)
    raise ValueError(f"unknown runtime {runtime!r}")
