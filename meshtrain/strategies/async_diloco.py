"""Asynchronous DiLoCo: dynamic local updates and delayed Nesterov (Liu, Chhaparia, Douillard,
Kale, Rusu, Shen, Szlam, Ranzato 2024, "Asynchronous Local-SGD Training for Language
Modeling", arXiv 2401.09135), for machines of uneven speed.

Dynamic local updates (DyLU, the paper's Eq. 6). A worker w of speed v(w) runs::

    steps(w) = max(1, floor(v(w) / max_w' v(w') * H))

inner steps per job: the fastest runs H, one three times slower about H / 3, so every job
lasts about as long on the wall clock. ``dylu=False`` gives every worker H steps.

Delayed Nesterov (DN, the paper's Algorithm 3). The server model theta takes every
pseudo-gradient g_t = theta_start - theta_w (theta_start: the server model the worker's job
began from) as it is applied, t = 0, 1, 2, ... counting updates::

    Delta = Delta + g_t
    if (t + 1) % N == 0:                   # every N-th update: the momentum moves
        m = beta * m + Delta / N
        theta = theta - eps * ((1 - c*N + c) * beta * m + g_t / N)
        Delta = 0
    else:                                  # in between: a plain step, momentum held
        theta = theta - eps * (c * beta * m + g_t / N)

with eps = ``outer_lr``, beta = ``outer_momentum``, N = ``buffer_size`` (default: the number of
nodes) and c = ``momentum_activation`` in [0, 1/N] (the paper's default 0). With N = 1 and
c = 0 this is Nesterov SGD (the paper's Eq. 4, torch's ``SGD(nesterov=True)``); and when the N
updates between two momentum steps are one group that began from the same theta, their sum is
DiLoCo's outer step on their mean, exactly.

When updates arrive: the paper's Algorithm 2 (asynchronous task scheduling), with the wall
clock simulated from the workers' speeds. Time is counted in steps of the fastest worker:
loop step L of the training loop is the interval [L, L + 1). A worker of speed s (relative
to the fastest) takes 1/s of them per inner step; a job begun at loop step b runs its j-th
inner step (0-based) in the loop step where it starts, ``floor(b + j / s)``, and does nothing
in the others (the training loop skips them: no batch, no forward or backward; on a real
host a skipped step costs nothing, so the host's own pace sets the wall clock). Its update
arrives at ``b + steps / s``. The first arrival opens a group; the server waits ``grace`` loop
steps (the paper's grace period) or until every worker has arrived, whichever is first, and
then applies the group's updates one by one in the order they arrived (ties by rank), each a
DN update, and every worker of the group begins its next job from the resulting theta at the
next loop step. Workers outside the group train on from their older theta: their updates
arrive stale. The default ``grace`` is the slowest worker's step less one loop step, so under
DyLU (whose jobs end within one step of the slowest worker of each other) every round's
updates meet in one group; ``grace=0`` or ``dylu=False`` let the workers drift apart.

There is no server: every node holds theta and the DN state and applies every update, as
DiLoCo's nodes all apply the outer step. An update travels as one broadcast from its worker
(in fp32, applied bit for bit alike everywhere). The schedule is a function of the speeds
alone, so the threads, processes and launched runtimes give the same result for the same
speeds.

Where the speeds come from: the ``speeds`` parameter when given (one number per node,
relative); else, in ``meshtrain simulate``, ``--straggler`` (speed 1 / slowdown); else, on
launched hosts, measured: every worker runs min(H, 6) steps in the first job, each rank
times its steps 2 to 6 (wall time less time in collectives) and at that job's end the ranks
all-gather their seconds per step (unrecorded) and take DyLU step counts from them for the
rest of the run. A claim that is not a finite number > 0 or longer than the measured window
itself makes every rank keep equal speeds (a warning says so).

Deviations from the paper, on purpose:

* Each node trains on its own shard (the paper samples a shard per job inversely to its
  progress): a slower node sees fewer of its shard's samples.
* The learning rate follows the loop step (the fastest worker's clock) rather than each
  shard's own count of inner steps: a worker at speed s has done about s * L of its
  s * max_steps inner steps at loop step L, the same fraction, so the schedule's shape is
  the paper's per-shard one (warmup is counted in the fastest worker's steps).
* Arrival times are rounded to loop steps: updates that arrive within one loop step are
  grouped even with ``grace=0``.
* At the end of training every worker's unsent progress is applied (ordered by when its last
  inner step ended, then rank) and every node ends on theta.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from meshtrain.strategies.base import CommunicationModule, Optim, Strategy

_EPS = 1e-9  # float slack when times on the simulated clock are rounded to loop steps
#: A launched rank times its steps 2 to this + 1 (the first pays one-off costs) in a first job
#: every node runs at once, then takes DyLU's step counts from the gathered times.
MEASURED_STEPS = 5


def dylu_steps(speeds: Sequence[float], H: int) -> list[int]:
    """Inner steps per job of each worker (Eq. 6): ``max(1, floor(v / max v * H))``."""
    fastest = max(speeds)
    return [max(1, math.floor(v / fastest * H + _EPS)) for v in speeds]


class Timeline:
    """When each worker trains and when its updates reach the server, on the clock of the
    fastest worker (loop steps). The same on every node: a function of the speeds."""

    def __init__(self, nodes: int, H: int, dylu: bool, grace: int | None) -> None:
        self.H, self.dylu, self.grace_given = H, dylu, grace
        self.set_speeds([1.0] * nodes)
        self.start = [0] * nodes  # the loop step each worker's job began at
        self.length = list(self.job_steps)  # inner steps of each worker's job

    def set_speeds(self, speeds: Sequence[float]) -> None:
        """Speeds relative to any unit; jobs begun from now on use them."""
        fastest = max(speeds)
        self.speeds = [v / fastest for v in speeds]
        self.per_step = [1.0 / v for v in self.speeds]  # loop steps one inner step takes
        self.job_steps = dylu_steps(self.speeds, self.H) if self.dylu else [self.H] * len(speeds)
        self.grace = self.grace_given if self.grace_given is not None \
            else max(0, math.ceil(max(self.per_step) - _EPS) - 1)

    def arrival(self, rank: int) -> float:
        """When the update of ``rank``'s current job reaches the server."""
        return self.start[rank] + self.length[rank] * self.per_step[rank]

    def arrival_step(self, rank: int) -> int:
        """The loop step in which it arrives."""
        return math.ceil(self.arrival(rank) - _EPS) - 1

    def trains(self, rank: int, step: int) -> bool:
        """Whether ``rank`` runs an inner step in loop step ``step``."""
        b, c = self.start[rank], self.per_step[rank]
        j = max(0, math.ceil((step - b) / c - _EPS))  # the first inner step starting at or after it
        return j < self.length[rank] and math.floor(b + j * c + _EPS) == step

    def closing(self, step: int, alive: Sequence[int]) -> list[int]:
        """The workers whose updates the server applies at the end of ``step``, in order of
        arrival (empty: none this step)."""
        arrived = [r for r in alive if self.arrival_step(r) <= step]
        if not arrived:
            return []
        opened = min(self.arrival_step(r) for r in arrived)
        if step < opened + self.grace and len(arrived) < len(alive):
            return []  # the grace period runs on: others may still arrive
        return sorted(arrived, key=lambda r: (self.arrival(r), r))

    def restart(self, ranks: Sequence[int], step: int) -> None:
        """``ranks`` begin new jobs at the loop step after ``step``."""
        for r in ranks:
            self.start[r], self.length[r] = step + 1, self.job_steps[r]

    def last_trained(self, rank: int, step: int) -> float | None:
        """When ``rank``'s last inner step up to loop step ``step`` ended, or None if its job
        has run none (the order of the final updates)."""
        b, c = self.start[rank], self.per_step[rank]
        done = sum(1 for j in range(self.length[rank]) if math.floor(b + j * c + _EPS) <= step)
        return b + done * c if done else None

    def state_dict(self) -> dict[str, Any]:
        return {"speeds": list(self.speeds), "start": list(self.start), "length": list(self.length)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.set_speeds(state["speeds"])
        self.start, self.length = list(state["start"]), list(state["length"])


class DelayedNesterov:
    """The server's optimizer, Algorithm 3 of the paper (the module docstring's update)."""

    def __init__(self, theta: list[torch.Tensor], lr: float, momentum: float, buffer_size: int,
                 activation: float) -> None:
        self.theta, self.lr, self.beta = theta, lr, momentum
        self.N, self.c = buffer_size, activation
        self.m = [torch.zeros_like(t) for t in theta]
        self.buffer = [torch.zeros_like(t) for t in theta]
        self.t = 0

    @torch.no_grad()
    def apply(self, g: Sequence[torch.Tensor]) -> None:
        """One server update with pseudo-gradient ``g``."""
        milestone = (self.t + 1) % self.N == 0
        momentum_share = (1 - self.c * self.N + self.c) if milestone else self.c
        for theta, m, buf, grad in zip(self.theta, self.m, self.buffer, g, strict=True):
            buf.add_(grad)
            if milestone:
                m.mul_(self.beta).add_(buf, alpha=1 / self.N)
                buf.zero_()
            step = grad / self.N
            if momentum_share:
                step.add_(m, alpha=momentum_share * self.beta)
            theta.sub_(step, alpha=self.lr)
        self.t += 1

    def state_dict(self) -> dict[str, Any]:
        return {"m": [t.clone() for t in self.m], "buffer": [t.clone() for t in self.buffer], "t": self.t}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for mine, saved in zip([*self.m, *self.buffer], [*state["m"], *state["buffer"]], strict=True):
            mine.copy_(saved)
        self.t = int(state["t"])


class AsyncOuterSync(CommunicationModule):
    """Asynchronous DiLoCo's outer loop: the timeline, the server copy and its DN updates."""

    def __init__(self, H: int, dylu: bool, grace: int | None, outer_lr: float, outer_momentum: float,
                 buffer_size: int | None, momentum_activation: float,
                 speeds: Sequence[float] | None) -> None:
        self.H, self.dylu, self.grace = H, dylu, grace
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.buffer_size, self.momentum_activation = buffer_size, momentum_activation
        self.speeds = speeds
        self.last_sync = -1  # the 0-based step the last group was applied after
        self.last_group: list[int] = []

    def setup(self, strategy: Strategy) -> None:
        super().setup(strategy)
        nodes = strategy.comm.world_size
        N = self.buffer_size if self.buffer_size is not None else nodes
        # theta lives in its own storage: aliasing the worker's tensors would make g 0.
        self.outer = [p.detach().clone() for p in strategy.params]
        self.anchor = [p.detach().clone() for p in strategy.params]  # theta at this job's start
        self.server = DelayedNesterov(self.outer, self.outer_lr, self.outer_momentum, N,
                                      self.momentum_activation)
        self.timeline = Timeline(nodes, self.H, self.dylu, self.grace)
        self.measuring = False
        self.last_sync, self.last_group = -1, []

    def use_speeds(self, simulated: Sequence[float] | None) -> None:
        """Before step 0: the speeds of the schedule (the module docstring's sources)."""
        if self.speeds is not None:
            if simulated is not None and len(set(simulated)) > 1:
                raise ValueError("give the nodes' speeds once: the strategy's speeds or --straggler")
            if len(self.speeds) != len(self.timeline.start):
                raise ValueError(f"speeds has {len(self.speeds)} values for {len(self.timeline.start)} nodes")
            self.timeline.set_speeds(self.speeds)
        elif simulated is not None:
            self.timeline.set_speeds(simulated)
        self.timeline.restart(range(len(self.timeline.start)), -1)
        if self.speeds is None and simulated is None:  # a launched host: measured first
            self.measuring = True
            self._timed_from: tuple[float, float] | None = None
            # A short first job at everyone's pace, then DyLU: the first steps are timed.
            self.timeline.length = [min(self.H, MEASURED_STEPS + 1)] * len(self.timeline.start)

    def trains_at(self, step: int) -> bool:
        return self.timeline.trains(self.strategy.comm.rank, step)

    def after_optimizer_step(self, step: int) -> None:
        if self.measuring and step == 0:
            self._timed_from = (time.perf_counter(), self.strategy.comm.log.seconds)
        group = self.timeline.closing(step, self.strategy.comm.alive)
        if not group:
            return
        if self.measuring and step >= 1 and len(group) == len(self.strategy.comm.alive):
            self.measure(step)
        self.apply_group(group)
        self.timeline.restart(group, step)
        self.last_sync, self.last_group = step, group

    @torch.no_grad()
    def apply_group(self, group: Sequence[int]) -> None:
        """Each member's pseudo-gradient, one broadcast from it, one DN update everywhere, in
        order; then every member restarts from theta."""
        comm, workers = self.strategy.comm, self.strategy.params
        rank = comm.rank
        mine = [a - p for a, p in zip(self.anchor, workers, strict=True)] if rank in group else []
        if len(group) > 1 and sorted(group) == comm.alive and len({t.dtype for t in self.outer}) == 1:
            # Everyone sends: one all-gather moves the same bytes as the broadcasts, at once.
            gathered = comm.all_gather(torch.cat([t.reshape(-1) for t in mine]))
            by_rank = dict(zip(comm.alive, gathered, strict=True))
            for member in group:
                flat, g = by_rank[member], []
                for t in self.outer:
                    g.append(flat[:t.numel()].view_as(t))
                    flat = flat[t.numel():]
                self.server.apply(g)
        else:
            for member in group:
                g = mine if member == rank else [torch.empty_like(t) for t in self.outer]
                comm.broadcast(g, src=member)
                self.server.apply(g)
        if rank in group:
            for theta, p, a in zip(self.outer, workers, self.anchor, strict=True):
                p.copy_(theta)
                a.copy_(theta)

    def measure(self, step: int) -> None:
        """A launched rank's seconds per inner step over steps 1..``step``, all-gathered with
        its wall seconds per step: the speeds of every later job. Every rank decides from the
        gathered numbers alone, so all take the same schedule."""
        assert self._timed_from is not None
        comm = self.strategy.comm
        began, waited = self._timed_from
        wall = time.perf_counter() - began
        mine = torch.tensor([(wall - (comm.log.seconds - waited)) / step, wall / step], dtype=torch.float64)
        gathered = [t.tolist() for t in comm.all_gather(mine, record=False)]
        claims = [float(c) for c, _ in gathered]
        # The round's longest wall time per step: no rank computed longer than that.
        longest = max(float(w) for _, w in gathered)
        self.measuring = False
        bad = [r for r, s in enumerate(claims)
               if not (math.isfinite(s) and math.isfinite(longest) and 1e-3 * longest <= s <= longest * 1.05)]
        if bad:
            if comm.rank == 0:
                print(f"warning: async-diloco: rank {bad[0]} reported {claims[bad[0]]!r} seconds per step "
                      f"beside rounds of {longest:.3g} s per step: every node keeps equal speeds",
                      file=sys.stderr, flush=True)
            return
        self.timeline.set_speeds([1.0 / s for s in claims])
        if comm.rank == 0:  # what the rest of the run does with them, said once
            speeds = ", ".join(f"{v:.2f}" for v in self.timeline.speeds)
            steps = ", ".join(str(n) for n in self.timeline.job_steps)
            print(f"async-diloco: measured speeds {speeds} (relative to the fastest): inner steps per "
                  f"round {steps}", file=sys.stderr, flush=True)

    @torch.no_grad()
    def finish(self, step: int) -> bool:
        """Every worker's unsent progress is applied (in the order its last inner step ended,
        then rank) and every node ends on theta."""
        line = self.timeline
        alive = self.strategy.comm.alive
        ended = {r: line.last_trained(r, step) for r in alive}  # None: a job that ran no step
        pending = sorted((r for r in alive if ended[r] is not None), key=lambda r: (ended[r], r))
        self.apply_group(pending)
        for theta, p in zip(self.outer, self.strategy.params, strict=True):
            p.copy_(theta)
        self.last_sync, self.last_group = step, list(alive)
        return True

    def global_parameters(self) -> list[torch.Tensor]:
        return self.outer

    def last_synced(self) -> int | None:
        return self.last_sync + 1  # 0 before the first group

    def synced(self, step: int) -> tuple[list[torch.Tensor], list[int] | None] | None:
        # theta is the same on every node after every group (whoever was in it).
        return (self.outer, None) if self.last_sync == step else None

    def state_dict(self) -> dict[str, Any]:
        return {"outer": [t.clone() for t in self.outer], "anchor": [t.clone() for t in self.anchor],
                "server": self.server.state_dict(), "timeline": self.timeline.state_dict(),
                "last_sync": self.last_sync, "last_group": list(self.last_group)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for mine, saved in zip([*self.outer, *self.anchor], [*state["outer"], *state["anchor"]], strict=True):
            mine.copy_(saved)
        self.server.load_state_dict(state["server"])
        self.timeline.load_state_dict(state["timeline"])
        self.measuring = False  # the speeds were measured (or given) before the checkpoint
        self.last_sync, self.last_group = int(state["last_sync"]), list(state["last_group"])


class AsyncDiLoCo(Strategy):
    """Asynchronous DiLoCo: each worker runs inner steps in proportion to its speed (DyLU) and
    the server applies each update as it arrives, its Nesterov momentum delayed (DN).

    Args:
        H: inner steps of the fastest worker per job (the paper runs 50).
        dylu: dynamic local updates: a worker of relative speed s runs max(1, floor(s * H)).
        grace: loop steps the server waits after a group's first update for others (None:
            the slowest worker's step less one, so DyLU's rounds meet in one group).
        outer_lr, outer_momentum: eps and beta of delayed Nesterov (DiLoCo's 0.7 and 0.9).
        buffer_size: N, updates between two momentum steps (None: the number of nodes).
        momentum_activation: c in [0, 1/N], the momentum's share applied between them (0).
        speeds: each node's relative speed (None: --straggler when simulated, measured when
            launched).
        optim, lr: the inner optimizer (AdamW, as DiLoCo's).
    """

    name = "async-diloco"
    display_name = "Async DiLoCo"
    listing_order = 75
    key_parameters = {"H": "H", "buffer_size": "N"}
    # Every node keeps theta and the server state, but a worker's job in progress is its own.
    continues_on_fewer_nodes = False
    balances = False
    balance_refusal = ("gives each node inner steps in proportion to its speed (dynamic local updates) "
                       "in place of --balance's shares of a step's samples: drop --balance")

    def __init__(
        self,
        H: int = 100,
        dylu: bool = True,
        grace: int | None = None,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        buffer_size: int | None = None,
        momentum_activation: float = 0.0,
        speeds: list[float] | None = None,
        optim: str | Optim = Optim("adamw", weight_decay=0.1, betas=(0.9, 0.95)),
        lr: float = 4e-4,
        **common: Any,
    ) -> None:
        if H < 1:
            raise ValueError(f"H must be >= 1, got {H}")
        if grace is not None and grace < 0:
            raise ValueError(f"grace must be >= 0 loop steps (or None), got {grace}")
        if not (math.isfinite(outer_lr) and outer_lr > 0):
            raise ValueError(f"outer_lr must be a finite number > 0, got {outer_lr}")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum}")
        if buffer_size is not None and buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1 (or None: the number of nodes), got {buffer_size}")
        if not (math.isfinite(momentum_activation) and momentum_activation >= 0):
            raise ValueError(f"momentum_activation must be a number >= 0, got {momentum_activation}")
        if speeds is not None:
            if isinstance(speeds, (str, bytes)) or not isinstance(speeds, Sequence) or not speeds or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                    for v in speeds):
                raise ValueError(f"speeds must be a list of numbers > 0, one per node, got {speeds!r}")
            speeds = [float(v) for v in speeds]
        self.H, self.dylu, self.grace = H, dylu, grace
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.buffer_size, self.momentum_activation, self.speeds = buffer_size, momentum_activation, speeds
        self.sync = AsyncOuterSync(H, dylu, grace, outer_lr, outer_momentum, buffer_size,
                                   momentum_activation, speeds)
        super().__init__(optim, lr, modules=[self.sync], **common)

    def check_nodes(self, nodes: int) -> None:
        if self.speeds is not None and len(self.speeds) != nodes:
            raise ValueError(f"speeds has {len(self.speeds)} values for {nodes} nodes")
        N = self.buffer_size if self.buffer_size is not None else nodes
        if self.momentum_activation > 1 / N + _EPS:
            raise ValueError(f"momentum_activation must be in [0, 1/buffer_size] = [0, {1 / N:.4g}], "
                             f"got {self.momentum_activation}")

    def check_speeds(self, simulated: Sequence[float]) -> None:
        if self.speeds is not None and len(set(simulated)) > 1:
            raise ValueError(f"strategy {self.name}: speeds={self.speeds} and --straggler both set the "
                             "nodes' speeds: give the nodes' speeds once")

    def use_node_speeds(self, simulated: Sequence[float] | None) -> None:
        self.sync.use_speeds(simulated)

    def trains_at(self, step: int) -> bool:
        return self.sync.trains_at(step)

    def relative_work(self) -> dict[int, float] | None:
        # A loop step lasts one step of the fastest worker; a slower one spreads its inner
        # step over 1/s of them: its compute per loop step is s times its own step's.
        return dict(enumerate(self.sync.timeline.speeds))

    def inner_steps_per_job(self) -> list[int]:
        """Each worker's inner steps per job under the speeds in force (DyLU)."""
        return list(self.sync.timeline.job_steps)
