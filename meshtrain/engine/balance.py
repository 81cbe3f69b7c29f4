"""``balance``: each node's share of every step's samples, in proportion to its throughput.

A MacBook Air next to a Mac Studio: with equal batches the fast host waits for the slow
one at every sync. With ``balance`` node i takes ``b_i`` samples a step, ``b_i``
proportional to its throughput and ``sum_i b_i = nodes * batch_size``: the global batch
of the unbalanced run, so the samples seen per step (and per DiLoCo round) are unchanged
and only their split moves. Every node still takes the same number of steps.

What is averaged, and how
-------------------------
Each node's loss is the mean over its own ``b_i`` samples, so its gradient ``g_i`` is the
mean of its per-sample gradients. Every average a strategy takes goes through
:meth:`~meshtrain.strategies.base.Strategy.mean_over_nodes_`, which under balance is the
sample-weighted mean ``sum_i b_i x_i / sum_i b_i`` (one all-reduce):

* DDP: ``x_i = g_i``; the result is the gradient of the mean loss over all ``B`` samples
  of the step, as one node holding the whole global batch computes it.
* DiLoCo, and the outer step of SPARTA+DiLoCo: ``x_i = theta - theta_i``, node i's
  pseudo-gradient, from the ``H * b_i`` samples it saw in the round.
* FedAvg: ``x_i = theta_i`` weighted by ``b_i`` (``weighted`` or not), in an island and
  over all nodes; SPARTA: the fraction p of parameters it averages, weighted by ``b_i``.
* DeMo refuses ``balance``: its update is the sign of a decoded sum.

Without ``balance`` nothing here runs and every mean is the plain one, bit for bit; so
it is with ``balance`` when the shares come out equal (``sum_i b x_i / (n b)`` would only
differ from the plain mean by rounding).

Where the throughput comes from
-------------------------------
* A launched rank (a real host) measures it: one untimed forward and backward pass of its
  first microbatch, then :data:`WARMUP_PASSES` timed ones. Gradients, buffers (batch-norm
  statistics) and torch's random streams are put back and the data position is not moved,
  so training starts as it would have. The ranks all-gather their samples per second
  (unrecorded: it is not training traffic).
* Simulated nodes share this machine, so timing them says nothing about the cluster they
  stand for: node i's throughput is ``1 / slowdown_i`` from ``--straggler`` (1 for the
  others). Equal nodes get equal shares, and ``balance`` then changes nothing.

Shares are a largest-remainder apportionment of the global batch, at least one sample each.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshtrain.comm import Communicator
from meshtrain.errors import SettingError

WARMUP_PASSES = 3  # timed forward+backward passes per rank (after one untimed)
MEASURED, STRAGGLERS = "measured", "straggler"


@dataclass(frozen=True)
class Shares:
    """Every node's samples per step and the throughput it was given for."""

    batch_sizes: tuple[int, ...]
    throughputs: tuple[float, ...]  # samples/s (measured) or relative speed (straggler)
    source: str  # MEASURED or STRAGGLERS

    @property
    def uneven(self) -> bool:
        """Whether nodes take different numbers of samples (equal shares: plain means)."""
        return len(set(self.batch_sizes)) > 1

    def work(self, batch_size: int) -> dict[int, float]:
        """Each node's samples per step relative to ``batch_size`` (its compute per step)."""
        return {r: b / batch_size for r, b in enumerate(self.batch_sizes)}

    def to_dict(self) -> dict[str, Any]:
        """What summary.json and config.yaml record."""
        total = sum(self.batch_sizes)
        unit = "samples_per_second" if self.source == MEASURED else "relative_speed"
        return {"source": self.source, "global_batch": total, "nodes": [
            {"node": r, "batch_size": b, "share": round(b / total, 4), unit: round(t, 4)}
            for r, (b, t) in enumerate(zip(self.batch_sizes, self.throughputs, strict=True))]}


def check_strategy(strategy: Any, balance: bool) -> None:
    """Raise :class:`SettingError` when ``balance`` is asked of a strategy that refuses it."""
    if balance and not getattr(strategy, "balances", True):
        raise SettingError(f"balance: {strategy.name} cannot weight its update by each node's "
                           "samples (DeMo applies the sign of a decoded sum); use it without balance")


def apportion(total: int, throughputs: Sequence[float]) -> list[int]:
    """``total`` samples split in proportion to ``throughputs``, each at least 1, summing to
    ``total`` exactly (largest remainders; ties go to the lower rank)."""
    n = len(throughputs)
    if total < n:
        raise ValueError(f"a global batch of {total} cannot give each of {n} nodes a sample")
    if not all(math.isfinite(t) and t > 0 for t in throughputs):
        raise ValueError(f"throughputs must be finite numbers > 0, got {list(throughputs)}")
    quotas = [total * t / sum(throughputs) for t in throughputs]
    sizes = [max(1, math.floor(q)) for q in quotas]
    by_remainder = sorted(range(n), key=lambda r: (-(quotas[r] - math.floor(quotas[r])), r))
    for r in by_remainder[: max(0, total - sum(sizes))]:
        sizes[r] += 1
    while sum(sizes) > total:  # the floor of 1 gave a tiny node more than its quota
        largest = max(range(n), key=lambda r: (sizes[r], -r))
        sizes[largest] -= 1
    return sizes


def simulated_shares(nodes: int, batch_size: int, stragglers: Mapping[int, float]) -> Shares:
    """Shares of simulated nodes: throughput ``1 / slowdown`` (``--straggler``), else 1."""
    speeds = [1.0 / stragglers.get(r, 1.0) for r in range(nodes)]
    return Shares(tuple(apportion(nodes * batch_size, speeds)), tuple(speeds), STRAGGLERS)


def measured_shares(comm: Communicator, batch_size: int, samples_per_second: float) -> Shares:
    """Shares from every rank's measured throughput (one unrecorded all-gather)."""
    mine = torch.tensor([samples_per_second], dtype=torch.float64)
    everyone = [float(t.item()) for t in comm.all_gather(mine, record=False)]
    return Shares(tuple(apportion(comm.world_size * batch_size, everyone)), tuple(everyone), MEASURED)


def measure_samples_per_second(model: nn.Module, forward: Callable[[], torch.Tensor], samples: int,
                               device: torch.device, passes: int = WARMUP_PASSES) -> float:
    """Samples per second of ``forward()`` (the loss of ``samples`` samples) plus its backward
    pass on this host, leaving the model, its gradients and torch's random streams as found."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = [b.detach().clone() for b in model.buffers()]
    cuda = [device.index or 0] if device.type == "cuda" else []
    mps_state = torch.mps.get_rng_state() if device.type == "mps" else None
    with torch.random.fork_rng(devices=cuda):  # dropout must not shift the training stream
        started = 0.0
        for i in range(passes + 1):
            if i == 1:  # the first pass warms caches and allocators up: not timed
                _wait_for(device)
                started = time.perf_counter()
            forward().backward()
        _wait_for(device)
        elapsed = time.perf_counter() - started
    if mps_state is not None:
        torch.mps.set_rng_state(mps_state)
    with torch.no_grad():
        for b, saved in zip(model.buffers(), buffers, strict=True):
            b.copy_(saved)
    for p, g in grads.items():
        p.grad = g
    return samples * passes / max(elapsed, 1e-9)


def _wait_for(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
