"""DiLoCo (Douillard et al. 2023, arXiv 2311.08105).

Each node runs H inner steps from the shared parameters theta, then::

    delta = theta - mean_i(theta_i)           # the outer gradient, ONE all-reduce
    theta = OuterSGD(theta, grad=delta)       # Nesterov momentum, on every node

Every node holds the outer optimizer and applies the identical step, so no broadcast
is needed. The inner optimizer state is never reset.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from meshtrain.comm.compression import PseudoGradientCompression, compression_from
from meshtrain.strategies.base import CommunicationModule, Optim, Strategy


class OuterSync(CommunicationModule):
    """The outer loop of DiLoCo: every ``H`` steps, average the outer gradient and step."""

    def __init__(self, H: int, outer_lr: float, outer_momentum: float, nesterov: bool,
                 compression: PseudoGradientCompression | None = None) -> None:
        if H < 1:
            raise ValueError(f"H must be >= 1, got {H}")
        if not (math.isfinite(outer_lr) and outer_lr > 0):
            raise ValueError(f"outer_lr must be a finite number > 0, got {outer_lr}")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum}")
        self.H = H
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.nesterov = nesterov
        self.compression = compression  # None: the exact fp32 all-reduce
        self.last_sync = -1  # the 0-based step of the last outer sync

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

    def after_optimizer_step(self, step: int) -> None:
        if (step + 1) % self.H == 0:
            self.sync(step)

    def finish(self, step: int) -> bool:
        if self.last_sync != step:  # no inner steps are left unsynchronised
            self.sync(step)
        return True

    @torch.no_grad()
    def sync(self, step: int) -> None:
        """One outer step: all-reduce theta - theta_i, step theta, restart from it."""
        workers = self.strategy.params
        deltas = [theta - p for theta, p in zip(self.outer, workers, strict=True)]
        # Under balance each pseudo-gradient counts by the samples its node saw this round.
        self.strategy.mean_pseudo_gradients_(deltas, self.compression)
        for theta, delta in zip(self.outer, deltas, strict=True):
            theta.grad = delta
        self.outer_optimizer.step()
        for theta, p in zip(self.outer, workers, strict=True):
            p.copy_(theta)
            theta.grad = None
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


class DiLoCo(Strategy):
    """DiLoCo: H local steps of an inner optimizer, then one outer Nesterov step.

    Args:
        H: inner steps between syncs (500 in the paper; 20-100 in small experiments).
        outer_lr, outer_momentum, nesterov: the outer SGD (paper: 0.7, 0.9, True).
        compression: how the outer gradient travels: fp32 (exact ring all-reduce), bf16,
            fp16, int8 or int4 (an all-gather of the encoded payloads, meshtrain/comm/compression.py).
        compression_block: values per float32 scale (int8, int4).
        error_feedback: carry what a payload lost into the next round's outer gradient.
        optim, lr: the inner optimizer (paper: AdamW, lr 4e-4, wd 0.1, betas 0.9/0.95).
    """

    name = "diloco"
    display_name = "DiLoCo"
    listing_order = 20
    key_parameters = {"H": "H"}
    # Checkpoints fall on outer syncs, where every node holds the outer parameters and the
    # same outer optimizer (the inner optimizer is each node's own).
    continues_on_fewer_nodes = True
    balances = True  # its averages go through mean_over_nodes_ (engine/balance.py)
    supports_vmap = True

    def __init__(
        self,
        H: int = 100,
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
        self.H = H
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.nesterov = nesterov
        self.compression = compression
        self.compression_block = compression_block
        self.error_feedback = error_feedback
        sync = OuterSync(H, outer_lr, outer_momentum, nesterov,
                         compression_from(compression, compression_block, error_feedback))
        super().__init__(optim, lr, modules=[sync], **common)

    def sync_interval(self) -> int | None:
        return self.H
