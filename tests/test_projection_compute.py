"""The projection's compute part is the nodes' own compute, not the runtime's overhead.

Compute is timed by each node's ComputeClock: forward, backward and the optimizer step,
on the node thread's CPU clock at one intra-op thread (the local runtimes' default),
with the time inside collectives taken out. Before, it was the loop's wall clock: the
same run was projected at 0.98 s from the threads runtime and 3.29 s from processes.
Each node's first step (~5x a later one: one-off set-up) is left out; with it in, the
two runtimes differed by up to 1.57x under the suite's load (processes pay it per node).

The runs use DiLoCo: with DDP the two runtimes do not run the same work. The processes
runtime all-reduces DDP's buckets on a second thread while the backward pass runs (the
threads runtime never does), and on this machine's two shared cores that thread slows the
backward pass it overlaps: the node's measured compute per step was 1.4-1.8 ms with the
overlap and 1.0-1.1 ms without it (quiet), 1.6-1.8 against 0.7-0.8 ms beside 3 busy loops.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from meshtrain import Trainer
from meshtrain.comm import ThreadCommunicator, ThreadHub
from meshtrain.engine.callbacks import ComputeClock
from meshtrain.strategies import DiLoCo

#: How far the two local runtimes' compute per step may differ (max / min). Both measure
#: the same kernels on the same machine; what remains is cache and scheduler noise under
#: load (measured 0.90-0.97 beside 3 busy loops on 2 cores; the wall clock gave 3.4).
SAME_COMPUTE_RATIO = 1.5


class Wide(nn.Module):
    """The benchmark's MLP: enough compute per step (~1 ms) to time."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(2048, 784, generator=g), torch.randint(0, 10, (2048,), generator=g))


def test_threads_and_processes_project_the_same_compute(tmp_path: Path) -> None:
    # Five runs of each, alternating, compared by their medians: a node thread's CPU time
    # still grows while other programs share the cores (caches, the other hyperthread), so
    # one pair of runs on this machine's two shared cores differed by up to 1.54x (quiet),
    # the medians of three by 1.21x (quiet) and once by 1.55x under the full suite's load
    # (processes 1.76-1.90 ms: all three runs in a busy spell; threads 1.14-1.76 ms).
    compute: dict[str, list[float]] = {"threads": [], "processes": []}
    for attempt in range(5):
        for runtime in compute:
            torch.manual_seed(0)
            result = Trainer(Wide(), _data()).fit(DiLoCo(H=10), nodes=2, max_steps=40, batch_size=32,
                                                  runtime=runtime, out_dir=tmp_path / f"{runtime}-{attempt}",
                                                  progress=False)
            projected = result.summary["projected"]
            compute[runtime].append(projected["step_seconds"])
            assert projected["compute_seconds"] == projected["step_seconds"] * 40  # gbe: speed 1
            # Far below the wall time per step, which holds start-up, waiting and the other node.
            assert 0 < projected["step_seconds"] < result.summary["wall_seconds"] / 40
    medians = [statistics.median(runs) for runs in compute.values()]
    assert max(medians) / min(medians) <= SAME_COMPUTE_RATIO, compute


def test_the_clock_leaves_out_waiting_inside_a_collective() -> None:
    hub = ThreadHub(2, timeout_s=30)
    comms = [ThreadCommunicator(hub, r) for r in range(2)]
    clock = ComputeClock(comms[0], own_thread=False)  # wall time, so sleeping counts as work
    late = threading.Thread(target=lambda: (time.sleep(0.4), comms[1].all_reduce(torch.ones(4))))
    late.start()
    with clock:
        time.sleep(0.05)  # node 0's own work
        comms[0].all_reduce(torch.ones(4))  # then it waits ~0.35 s for node 1
    late.join()
    assert 0.05 <= clock.seconds < 0.2


def test_the_first_step_is_left_out_of_the_compute_per_step() -> None:
    clock = ComputeClock(ThreadCommunicator(ThreadHub(1), 0), own_thread=True)
    clock.seconds = 5.0  # the first step's one-off costs
    clock.first_step_done()
    clock.seconds = 8.0  # and three steady steps of 1 s
    clock.first_step_done()  # a later call changes nothing
    assert clock.steady(4) == (3.0, 3)
    assert clock.steady(1) == (8.0, 1)  # a single step is all there is to go by
