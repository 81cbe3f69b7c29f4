"""DDP: average the gradients over all nodes every step, then one local step each."""

from __future__ import annotations

from typing import Any

from meshtrain.strategies.base import CommunicationModule, Optim, Strategy


class GradientAveraging(CommunicationModule):
    """One all-reduce (mean) of every gradient, as one flat bucket."""

    def before_optimizer_step(self, step: int) -> None:
        self.strategy.comm.all_reduce(self.strategy.grads(), op="mean")


class DDP(Strategy):
    """Data parallel training: gradients averaged every step (the baseline).

    Equal to one node training on the union of the nodes' batches.
    """

    name = "ddp"
    replicas_in_sync = True

    def __init__(self, optim: str | Optim = "adamw", lr: float = 1e-3, **common: Any) -> None:
        super().__init__(optim, lr, modules=[GradientAveraging()], **common)
