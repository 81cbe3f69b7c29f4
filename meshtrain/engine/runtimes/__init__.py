"""Where the nodes of a run live: threads in this process, local processes, or the
rank this process already is (launched by ``meshtrain launch`` or torchrun), or one
vectorised computation holding every node (vmap).

:data:`RUNNERS` is the registry: a runtime's name (the ``runtime`` setting) and the
function that runs a job on it. A new runtime joins here, in one line; the settings'
list of runtimes is checked against it (tests/test_runtime_registry.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from meshtrain.engine.job import FitResult, NodeJob
from meshtrain.engine.runtimes.launched import run_launched_rank
from meshtrain.engine.runtimes.processes import run_processes
from meshtrain.engine.runtimes.threads import run_threads
from meshtrain.engine.runtimes.vmap import run_vmap

Runner = Callable[[NodeJob], FitResult]

RUNNERS: Mapping[str, Runner] = MappingProxyType({
    "threads": run_threads,
    "processes": run_processes,
    "launched": run_launched_rank,
    "vmap": run_vmap,
})


def run(job: NodeJob) -> FitResult:
    """Run ``job`` on the runtime its config names."""
    try:
        runner = RUNNERS[job.config.runtime]
    except KeyError:
        raise ValueError(f"unknown runtime {job.config.runtime!r} (known: {', '.join(RUNNERS)})") from None
    return runner(job)
