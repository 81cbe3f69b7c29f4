"""Where the processes runtime's fixed time goes: one fit of the 4-node MLP, phase by phase.

    python benchmarks/processes_startup.py            # 1 step: start-up and finish only
    python benchmarks/processes_startup.py --steps 200

Each node process prints when it began (after the fork server forked it and it unpickled
its job) and when each phase started and ended, in seconds since ``fit`` was called:
joining the gloo group, setting up the node, training, rank 0's report (the run
directory: metrics, model, loss.png), the closing barrier, and leaving the group. The
parent prints how long each ``Process.start`` took. A warm-up fit runs first (not
timed), so the fork server has started and imported torch once, as for every fit after
the first in a process.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import runtimes  # noqa: E402 - the 4-node MLP workload of benchmarks/runtimes.py

from meshtrain.engine.runtimes import processes  # noqa: E402

PHASES = {  # module: functions timed inside a node process
    "meshtrain.engine.runtimes.launched": ("init_process_group", "train_node", "_barrier", "leave_in_order"),
    "meshtrain.engine.loop": ("_start_node", "_report"),
}
_fit_started = [0.0]


def _timed(rank: int, name: str, function: Callable[..., Any], t0: float) -> Callable[..., Any]:
    def phase(*args: Any, **kwargs: Any) -> Any:
        began = time.time()
        try:
            return function(*args, **kwargs)
        finally:
            ended = time.time()
            print(f"  node {rank}: {name:<18} +{began - t0:6.3f} s .. +{ended - t0:6.3f} s "
                  f"({ended - began:.3f} s)", flush=True)

    return phase


def timed_node(t0: float, job: Any, rank: int, *node_args: Any) -> None:
    """The node process's entry point (:func:`processes._node_process`, whatever it takes
    after ``job`` and ``rank``), with its phases timed."""
    import importlib

    if not t0:  # the warm-up fit: untimed
        processes._node_process(job, rank, *node_args)
        return
    print(f"  node {rank}: began              +{time.time() - t0:6.3f} s", flush=True)
    for module_name, names in PHASES.items():
        module = importlib.import_module(module_name)
        for name in names:
            setattr(module, name, _timed(rank, name, getattr(module, name), t0))
    processes._node_process(job, rank, *node_args)


_context = processes.node_context()


class TimedProcess(_context.Process):  # type: ignore[misc,name-defined]
    """A node process that runs :func:`timed_node` and reports its own start."""

    def __init__(self, target: Any = None, args: tuple[Any, ...] = (), **kwargs: Any) -> None:
        super().__init__(target=timed_node, args=(_fit_started[0], *args), **kwargs)

    def start(self) -> None:
        began = time.time()
        super().start()
        print(f"parent: {self.name} started in {time.time() - began:.3f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    _context.Process = TimedProcess
    processes.node_context = lambda: _context
    data = runtimes.make_data()
    runtimes.meshtrain_fit(data, "ddp", "processes", 5)  # warm-up: the fork server starts
    print(f"timed fit, DDP, {args.steps} steps:", flush=True)
    _fit_started[0] = time.time()
    wall = runtimes.meshtrain_fit(data, "ddp", "processes", args.steps)
    print(f"fit: {wall:.3f} s")


if __name__ == "__main__":
    main()
