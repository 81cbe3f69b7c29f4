"""DiLoCo (Douillard et al. 2023, arXiv 2311.08105).

Each node runs H inner steps from the shared parameters theta, then::

    delta = theta - mean_i(theta_i)           # the outer gradient, ONE all-reduce
    theta = OuterSGD(theta, grad=delta)       # Nesterov momentum, on every node

Every node holds the outer optimizer and applies the identical step, so no broadcast
is needed. The inner optimizer state is never reset.

With ``delay=1`` the outer step is overlapped with the next round (one round of staleness,
the "one-step delayed" outer update of Kale, Douillard and Donchev 2025, arXiv 2502.12996,
which PCCL runs as "async DiLoCo"). Each node keeps ``a``, its parameters when the round
began. At the end of round t::

    d_t = a - theta_i                       # this round's local progress, negated
    wait for mean(d_{t-1}) (started at round t-1's end); theta = OuterSGD(theta, it)
    theta_i = theta - d_t                   # the new global model plus this round's progress
    a = theta_i; start the all-reduce of d_t, to be waited for at round t+1's end

so round t's average is applied at the end of round t+1 while round t+1 trains (in the
first round there is nothing to apply). At the end of training the last average is
waited for and applied, then the progress since the last round end is averaged and
applied at once, and every node ends on theta.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from meshtrain.comm.communicator import BesideTraining, Pending
from meshtrain.comm.compression import PseudoGradientCompression, compression_from
from meshtrain.strategies.base import CommunicationModule, Optim, Strategy


class OuterSync(CommunicationModule):
    """The outer loop of DiLoCo: every ``H`` steps, average the outer gradient and step
    (``delay=1``: the average of each round is applied at the end of the next)."""

    def __init__(self, H: int, outer_lr: float, outer_momentum: float, nesterov: bool,
                 compression: PseudoGradientCompression | None = None, delay: int = 0) -> None:
        if H < 1:
            raise ValueError(f"H must be >= 1, got {H}")
        if not (math.isfinite(outer_lr) and outer_lr > 0):
            raise ValueError(f"outer_lr must be a finite number > 0, got {outer_lr}")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum}")
        if delay not in (0, 1):
            raise ValueError(f"delay must be 0 or 1 (rounds an outer step waits), got {delay}")
        self.H = H
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.nesterov = nesterov
        self.compression = compression  # None: the exact fp32 all-reduce
        self.last_sync = -1  # the 0-based step of the last outer sync
        self.delay = delay

    def setup(self, strategy: Strategy) -> None:
        super().setup(strategy)
        # theta lives in its own storage: aliasing the worker's tensors would make delta 0.
        self.outer = [p.detach().clone() for p in strategy.params]
        self.outer_optimizer = torch.optim.SGD(
            self.outer,
            lr=self.outer_lr,
            momentum=self.outer_momentum,
            nesterov=self.nesterov and self.outer_momentum > 0,
        )
        self.last_sync = -1
        if self.delay:
            self.beside = BesideTraining(strategy.comm)
            self.anchor = [p.detach().clone() for p in strategy.params]
            # The averaged progress of the last round, still on its way.
            self.in_flight: tuple[list[torch.Tensor], Pending] | None = None

    def after_optimizer_step(self, step: int) -> None:
        if (step + 1) % self.H == 0:
            if self.delay:
                self.delayed_sync(step)
            else:
                self.sync(step)

    def finish(self, step: int) -> bool:
        if self.delay:
            self.finish_delayed(step)
        elif self.last_sync != step:  # no inner steps are left unsynchronised
            self.sync(step)
        return True

    @torch.no_grad()
    def sync(self, step: int) -> None:
        """One outer step: all-reduce theta - theta_i, step theta, restart from it."""
        workers = self.strategy.params
        deltas = [theta - p for theta, p in zip(self.outer, workers, strict=True)]
        # Under balance each pseudo-gradient counts by the samples its node saw this round.
        self.strategy.mean_pseudo_gradients_(deltas, self.compression)
        self.outer_step(deltas)
        for theta, p in zip(self.outer, workers, strict=True):
            p.copy_(theta)
        self.last_sync = step

    @torch.no_grad()
    def outer_step(self, averaged: list[torch.Tensor]) -> None:
        """theta = OuterSGD(theta, grad=averaged)."""
        for theta, delta in zip(self.outer, averaged, strict=True):
            theta.grad = delta
        self.outer_optimizer.step()
        for theta in self.outer:
            theta.grad = None

    @torch.no_grad()
    def delayed_sync(self, step: int) -> None:
        """A round's end under ``delay=1`` (the module docstring's steps)."""
        workers = self.strategy.params
        progress = [a - p for a, p in zip(self.anchor, workers, strict=True)]
        if self.in_flight is not None:
            averaged, pending = self.in_flight
            pending.wait()
            self.outer_step(averaged)
            for theta, p, d in zip(self.outer, workers, progress, strict=True):
                torch.sub(theta, d, out=p)
        for a, p in zip(self.anchor, workers, strict=True):
            a.copy_(p)
        strategy, compression = self.strategy, self.compression
        self.in_flight = (progress, self.beside.start(
            lambda comm: strategy.mean_pseudo_gradients_(progress, compression, comm=comm), self.H))
        self.last_sync = step

    @torch.no_grad()
    def finish_delayed(self, step: int) -> None:
        """Apply the average still on its way, then average the progress since the last
        round end and apply it at once: every node ends on theta."""
        workers = self.strategy.params
        progress = ([a - p for a, p in zip(self.anchor, workers, strict=True)]
                    if self.last_sync != step else None)
        if self.in_flight is not None:
            averaged, pending = self.in_flight
            pending.wait()
            self.outer_step(averaged)
            self.in_flight = None
        if progress is not None:
            self.strategy.mean_pseudo_gradients_(progress, self.compression)
            self.outer_step(progress)
        for theta, p, a in zip(self.outer, workers, self.anchor, strict=True):
            p.copy_(theta)
            a.copy_(theta)
        self.last_sync = step

    def global_parameters(self) -> list[torch.Tensor]:
        return self.outer

    def last_synced(self) -> int | None:
        return self.last_sync + 1  # 0 before the first outer sync

    def synced(self, step: int) -> tuple[list[torch.Tensor], list[int] | None] | None:
        return (self.outer, None) if self.last_sync == step else None

    def state_dict(self) -> dict[str, Any]:
        state = {
            "outer": [t.clone() for t in self.outer],
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "last_sync": self.last_sync,
        }
        if self.delay:
            # The average on its way is waited for (it is the same on every node) and saved
            # unapplied: a resumed run applies it at the same step as an uninterrupted one.
            state["anchor"] = [a.clone() for a in self.anchor]
            if self.in_flight is not None:
                records = self.in_flight[1].saved()  # first: the average is written in place
                state["in_flight"] = ([t.clone() for t in self.in_flight[0]], records)
            else:
                state["in_flight"] = None
        if self.compression is not None:  # the error-feedback residual is this node's own
            state["compression"] = self.compression.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for theta, saved in zip(self.outer, state["outer"], strict=True):
            theta.copy_(saved)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.last_sync = state["last_sync"]
        if self.compression is not None:
            self.compression.load_state_dict(state.get("compression", {}))
        if self.delay:
            for a, saved in zip(self.anchor, state["anchor"], strict=True):
                a.copy_(saved)
            saved_flight = state["in_flight"]
            self.in_flight = None if saved_flight is None else (
                [t.clone() for t in saved_flight[0]], Pending.restored(self.strategy.comm, saved_flight[1]))


class OuterSGDStrategy(Strategy):
    """The arguments every strategy with DiLoCo's outer loop takes, defined once.

    A subclass sets its own arguments (its schedule: H, fragments, ...) and calls this
    constructor, which stores these and builds the subclass's :meth:`outer_modules`.

    Args:
        outer_lr, outer_momentum, nesterov: the outer SGD (paper: 0.7, 0.9, True).
        compression: how the outer gradient travels: fp32 (exact ring all-reduce), bf16,
            fp16, int8 or int4 (an all-gather of the encoded payloads, meshtrain/comm/compression.py).
        compression_block: values per float32 scale (int8, int4).
        error_feedback: carry what a payload lost into the next round's outer gradient.
        optim, lr: the inner optimizer (paper: AdamW, lr 4e-4, wd 0.1, betas 0.9/0.95).
    """

    def __init__(
        self,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        compression: str = "fp32",
        compression_block: int = 128,
        error_feedback: bool = False,
        optim: str | Optim = Optim("adamw", weight_decay=0.1, betas=(0.9, 0.95)),
        lr: float = 4e-4,
        **common: Any,
    ) -> None:
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.nesterov = nesterov
        self.compression = compression
        self.compression_block = compression_block
        self.error_feedback = error_feedback
        super().__init__(optim, lr, modules=self.outer_modules(), **common)

    def outer_modules(self) -> list[CommunicationModule]:
        """The communication modules, built from the arguments stored on ``self``."""
        raise NotImplementedError

    def new_compression(self) -> PseudoGradientCompression | None:
        """A fresh compression of one pseudo-gradient (its own error-feedback residual), None
        for fp32."""
        return compression_from(self.compression, self.compression_block, self.error_feedback)


class DiLoCo(OuterSGDStrategy):
    """DiLoCo: H local steps of an inner optimizer, then one outer Nesterov step.

    Args:
        H: inner steps between syncs (500 in the paper; 20-100 in small experiments).
        delay: 1 applies each round's average at the end of the next round, its all-reduce
            overlapping that round's training (arXiv 2502.12996); 0 (default) waits for it.
        outer_lr, outer_momentum, nesterov, compression, compression_block, error_feedback,
            optim, lr: see :class:`OuterSGDStrategy`.
    """

    name = "diloco"
    display_name = "DiLoCo"
    listing_order = 20
    key_parameters = {"H": "H"}
    # Checkpoints fall on outer syncs, where every node holds the outer parameters and the
    # same outer optimizer (the inner optimizer is each node's own).
    continues_on_fewer_nodes = True
    elastic = True  # a joiner takes a healthy node's state at an outer sync (delay=1 too)
    balances = True  # its averages go through mean_over_nodes_ (engine/balance.py)
    supports_vmap = True

    def __init__(self, H: int = 100, *, delay: int = 0, **shared: Any) -> None:
        self.H = H
        self.delay = delay
        super().__init__(**shared)

    def outer_modules(self) -> list[CommunicationModule]:
        return [OuterSync(self.H, self.outer_lr, self.outer_momentum, self.nesterov,
                          self.new_compression(), self.delay)]

    def sync_interval(self) -> int | None:
        return self.H

    def fewer_nodes_problem(self) -> str | None:
        if self.delay:
            return ("with delay=1 each node's parameters carry its own progress since the last "
                    "round end: a checkpoint cannot continue on fewer nodes")
        return None

    def elastic_problem(self) -> str | None:
        # delay=1 too: a joiner takes a healthy node's whole state at a round's end (its
        # anchor, its parameters with that node's progress in them, the average on its way,
        # complete in an elastic run) and from then on sends its own progress.
        return None
