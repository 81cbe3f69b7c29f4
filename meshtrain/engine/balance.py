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
* A launched rank (a real host) measures it on real training steps: its first steps run
  with equal shares, exactly as without ``balance``, and it times steps 2 to
  ``WARMUP_STEPS + 1``, compute only (wall time minus time inside collectives). At the
  first sync boundary after them (the next step for DDP and SPARTA, the end of the round
  for DiLoCo and FedAvg, so every round's weights are the samples it saw) the ranks
  all-gather their samples per second (unrecorded: not training traffic) and take their
  shares from the next step on; again after windows of twice as many steps each time, up to
  every ``REBALANCE_STEPS`` steps (see :class:`Balancer`). summary.json and config.yaml
  record the last shares.
* Simulated nodes share this machine, so timing them says nothing about the cluster they
  stand for: node i's throughput is ``1 / slowdown_i`` from ``--straggler`` (1 for the
  others). Equal nodes get equal shares, and ``balance`` then changes nothing.

Shares are a largest-remainder apportionment of the global batch, at least one sample each.

What a rank may claim
---------------------
A rank's samples per second are its own word, and its host may lie. Every claim comes with
the window's wall time per step, which the steps' syncs make the same on every rank, and
is refused (:func:`refused_claim`) unless it is a finite number > 0 whose compute per step
(its samples over its speed) lies between :data:`MIN_COMPUTE_SHARE` of that wall time and
the wall time itself (a rank cannot have computed longer than the step lasted). And the
shares must keep their promise: when the steps with them take more than
:data:`MAX_SLOWDOWN` times the equal split's (every rank observes that), the rank that took
the most samples beyond its equal share is named and every rank goes back to equal shares
for the rest of the run. Every rank takes the same decision from the same gathered numbers.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from meshtrain.comm import Communicator
from meshtrain.config.environment import launched_host_names
from meshtrain.data import NodeBatches
from meshtrain.errors import SettingError
from meshtrain.strategies import Strategy

WARMUP_STEPS = 5  # timed training steps of a launched rank before its share is set
REBALANCE_STEPS = 20  # the longest later window, after which the shares are set again
MEASURED, STRAGGLERS = "measured", "straggler"
#: A claimed compute per step below this fraction of the step's wall time is refused: no
#: host computes in a thousandth of a step it then waits through (and 1e308 samples/s once
#: overflowed the shares' sum on every rank).
MIN_COMPUTE_SHARE = 1e-3
#: Steps with the shares may take this times the equal split's before the claims are refused
#: (hosts drift by 10 to 20% here; a 5x lie made them about 2x slower).
MAX_SLOWDOWN = 1.5


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
    if balance and getattr(strategy, "balance_refusal", None):
        raise SettingError(f"balance: strategy {strategy.name} {strategy.balance_refusal}")
    if balance and not getattr(strategy, "balances", False):
        raise SettingError(f"balance: strategy {strategy.name} does not weight its averages by each "
                           "node's samples (DeMo applies the sign of a decoded sum; a strategy of your own "
                           "averages through Strategy.mean_over_nodes_ and sets balances = True)")


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


@dataclass(frozen=True)
class Claim:
    """What one rank says of the window just timed."""

    speed: float  # samples per second over the windows so far (earlier ones halved): its share's weight
    window_speed: float  # samples per second in this window alone
    step_seconds: float  # wall seconds per step of this window (the same on every honest rank)


def gather_claims(comm: Communicator, claim: Claim) -> list[Claim]:
    """Every rank's claim (one unrecorded all-gather)."""
    mine = torch.tensor([claim.speed, claim.window_speed, claim.step_seconds], dtype=torch.float64)
    return [Claim(*(float(x) for x in t.tolist())) for t in comm.all_gather(mine, record=False)]


def refused_claim(claims: Sequence[Claim], batch_sizes: Sequence[int],
                  names: Sequence[str] | None = None) -> str | None:
    """Why the first rank whose claim cannot be true is refused (None when every claim may
    be). The step's wall time is the longest any rank reports (an honest rank's is the
    step's): a rank's compute per step on its ``batch_sizes`` samples at its window's speed
    must lie between :data:`MIN_COMPUTE_SHARE` of it and the wall time itself (5% allowed),
    at its smoothed speed within a thousandfold of it either way. ``names``: each rank's host,
    named beside its rank."""
    def who(rank: int) -> str:
        return f"rank {rank} ({names[rank]})" if names is not None else f"rank {rank}"

    for rank, c in enumerate(claims):
        for name, value in (("a step time", c.step_seconds), ("a speed", c.speed),
                            ("a window speed", c.window_speed)):
            if not (math.isfinite(value) and value > 0):
                return f"{who(rank)} reported {name} of {value!r}, not a finite number > 0"
    wall = max(c.step_seconds for c in claims)
    for rank, (c, samples) in enumerate(zip(claims, batch_sizes, strict=True)):
        compute = samples / c.window_speed
        if not MIN_COMPUTE_SHARE * wall <= compute <= wall * 1.05:
            return (f"{who(rank)} claimed {c.window_speed:.4g} samples/s: its {samples} samples would "
                    f"take {compute:.3g} s, where its steps took {wall:.3g} s")
        if not MIN_COMPUTE_SHARE * wall <= samples / c.speed <= wall / MIN_COMPUTE_SHARE:
            return (f"{who(rank)} claimed {c.speed:.4g} samples/s over its windows, beside steps of "
                    f"{wall:.3g} s")
    return None


def equal_shares(nodes: int, batch_size: int) -> Shares:
    """Every node ``batch_size`` samples: what a run without ``balance`` takes."""
    return Shares((batch_size,) * nodes, (1.0,) * nodes, MEASURED)


class Balancer:
    """One node's side of ``balance``: its share of each step's samples, applied to its
    batches and its strategy's means, and (launched) the timing of its warm-up steps.

    Simulated nodes get their shares before step 0. A launched rank trains its first
    steps with equal shares, exactly as without ``balance``; it times steps 2 to
    ``warmup_steps + 1`` (the first has one-off costs), counting compute only (wall time
    minus time inside recorded collectives, which is waiting and transfer). At the first
    sync boundary after them (every step for DDP and SPARTA, the end of a round for
    DiLoCo and FedAvg, so a round's weights are the samples it saw) every rank all-gathers
    its samples per second and takes its share from the next step on. The same happens
    again after each later window (at a sync boundary), timed with the shares then in
    force: a host that slows down later (heat, other work) or whose speed per sample
    depends on its batch size is followed. The later windows double from ``warmup_steps``
    up to ``REBALANCE_STEPS`` steps (5, 10, 20, 20, ... after the warm-up): warm-up steps
    that something else on the host slowed for a moment (seen on a busy machine: a 1-core
    host measured at less than its half-core peer) set the shares for 5 steps, not 20.
    Each estimate is the samples over the compute seconds of every window so far, an
    earlier window counting half as much at each new one.
    """

    def __init__(self, comm: Communicator, nodes: int, batch_size: int, *, measured: bool,
                 stragglers: Mapping[int, float], sync_interval: int | None,
                 warmup_steps: int = WARMUP_STEPS) -> None:
        self.comm, self.batch_size, self.warmup_steps = comm, batch_size, warmup_steps
        self.sync_interval = sync_interval or 1
        self.shares = None if measured else simulated_shares(nodes, batch_size, stragglers)
        self.source_fixed = not measured  # simulated shares never change
        self.rebalance_steps = REBALANCE_STEPS
        self.rebalances = 0  # times the measured shares were set again
        self.balanced_from: int | None = None  # the first (0-based) step taken with the shares
        # Where the current timing window began: (clock, collective seconds, 0-based step).
        self._timed_from: tuple[float, float, int] | None = None
        self._since = (time.perf_counter(), comm.log.seconds)
        # Samples and compute seconds of the windows timed so far, each earlier window's
        # weight halved at every new one: one short window's noise (a host descheduled for a
        # moment) does not set the shares alone, and a lasting change is followed within a
        # few windows.
        self._samples = self._compute = 0.0
        self.equal_step_seconds: float | None = None  # the warm-up's steps, with equal shares
        self.refused: str | None = None  # why the claims were refused (equal shares since)
        self.names = launched_host_names(comm.world_size) if measured else None  # to name a host

    def start(self, batches: NodeBatches, strategy: Strategy) -> None:
        """Before step 0: simulated nodes take their shares now."""
        if self.shares is not None:
            self._apply(batches, strategy, 0)

    def step_done(self, step: int, batches: NodeBatches, strategy: Strategy) -> bool:
        """After 0-based ``step``: time the warm-up; at the first sync boundary after it, agree
        on the shares and take this node's from the next step. True when the shares changed."""
        if self.shares is not None and self.source_fixed:
            return False
        now = time.perf_counter()
        if step == 0:
            self._timed_from = (now, self.comm.log.seconds, 1)
            return False
        assert self._timed_from is not None
        began, waited, first = self._timed_from
        window = self.window_steps()
        if step + 1 - first < window or (step + 1) % self.sync_interval:
            return False
        compute = (now - began) - (self.comm.log.seconds - waited)
        self._samples = self._samples / 2 + batches.batch_size * (step + 1 - first)
        self._compute = self._compute / 2 + max(compute, 1e-9)
        # Checked against this window's batch sizes and wall time; the shares are set by the
        # smoothed speed (checked more loosely: it remembers earlier windows).
        steps = step + 1 - first
        claims = gather_claims(self.comm, Claim(self._samples / self._compute,
                                                batches.batch_size * steps / max(compute, 1e-9),
                                                (now - began) / steps))
        sizes = self.shares.batch_sizes if self.shares is not None else (self.batch_size,) * len(claims)
        problem = refused_claim(claims, sizes, self.names)
        wall = max(c.step_seconds for c in claims) if problem is None else math.inf
        if self.shares is None:
            self.equal_step_seconds = wall
        elif problem is None and self.equal_step_seconds is not None \
                and wall > MAX_SLOWDOWN * self.equal_step_seconds:
            gained = max(range(len(sizes)), key=lambda r: (sizes[r], -r))
            who = f"rank {gained} ({self.names[gained]})" if self.names is not None else f"rank {gained}"
            problem = (f"{who}'s claimed speed gave it {sizes[gained]} of {sum(sizes)} samples a "
                       f"step, and the steps then took {wall / self.equal_step_seconds:.1f}x as long "
                       "as with equal shares")
        if problem is None:
            speeds = [c.speed for c in claims]
            shares = Shares(tuple(apportion(self.comm.world_size * self.batch_size, speeds)),
                            tuple(speeds), MEASURED)
        else:
            self.refused = f"{problem}: its claims are refused, every node takes equal shares"
            self.source_fixed = True  # no more claims taken: the rest of the run is unbalanced
            shares = equal_shares(self.comm.world_size, self.batch_size)
            if self.comm.rank == 0:
                print(f"warning: --balance: {self.refused}", file=sys.stderr, flush=True)
        self.rebalances += self.shares is not None
        self.shares = shares
        self._apply(batches, strategy, step + 1)
        self._timed_from = (time.perf_counter(), self.comm.log.seconds, step + 1)
        return True

    def window_steps(self) -> int:
        """Steps in the timing window now running: the warm-up, then twice as many at each
        new window, up to ``rebalance_steps``."""
        if self.shares is None:
            return self.warmup_steps
        return min(self.rebalance_steps, self.warmup_steps << self.rebalances)

    def _apply(self, batches: NodeBatches, strategy: Strategy, step: int) -> None:
        assert self.shares is not None
        batches.resize(self.shares.batch_sizes[self.comm.rank])
        # Uneven shares make every mean the sample-weighted one; even ones the plain mean.
        strategy.sample_weight = float(self.shares.batch_sizes[self.comm.rank]) if self.shares.uneven \
            else None
        if self.balanced_from is None:
            self.balanced_from = step
            self._since = (time.perf_counter(), self.comm.log.seconds)

    def collective_share(self) -> float | None:
        """Share of this node's wall time inside recorded collectives since its shares took
        effect (waiting for the slowest node, plus the transfer); None before."""
        if self.balanced_from is None:
            return None
        wall = time.perf_counter() - self._since[0]
        return (self.comm.log.seconds - self._since[1]) / wall if wall > 0 else None

    def to_dict(self) -> dict[str, Any]:
        """What summary.json and config.yaml record (1-based step numbers)."""
        if self.shares is None:
            return {"source": MEASURED, "balanced_from_step": None,
                    "note": f"the run ended within its {self.warmup_steps + 1} warm-up steps"}
        return {**self.shares.to_dict(), "balanced_from_step": (self.balanced_from or 0) + 1,
                "rebalances": self.rebalances, **({"refused": self.refused} if self.refused else {})}
