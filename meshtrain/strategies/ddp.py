"""DDP: average the gradients over all nodes every step, then one local step each."""

from __future__ import annotations

from typing import Any

from meshtrain.comm.buckets import GradientBuckets
from meshtrain.strategies.base import CommunicationModule, Optim, Strategy


class GradientAveraging(CommunicationModule):
    """An all-reduce (mean) of every gradient plus one has-gradient flag per tensor, in
    buckets of about 256 KiB (:mod:`meshtrain.comm.buckets`), the flags in the last:
    about ``2(g-1)/g * (numel + tensors)`` elements per node. Where the runtime can
    (processes, real hosts), a bucket goes on the wire while the backward pass still runs.

    As in torch DDP, a gradient missing on some nodes counts as zero in the mean, and a
    parameter with no gradient on any node keeps ``grad = None`` (the flags tell), so the
    optimizer, weight decay included, leaves it untouched.
    """

    def setup(self, strategy: Strategy) -> None:
        super().setup(strategy)
        # Cut once from the parameter list: every runtime all-reduces the same buckets.
        self.buckets = GradientBuckets(strategy.comm, strategy.params, nodes=strategy.stacked_nodes)

    def before_sole_backward(self, step: int) -> None:
        weight = self.strategy.sample_weight  # as mean_over_nodes_ will reduce
        self.buckets.start_during_backward(step, op="mean" if weight is None else "sum", scale=weight)

    def before_optimizer_step(self, step: int) -> None:
        strategy = self.strategy
        grads = strategy.grads()
        flags = strategy.grad_flags
        # Under balance, weighted by each node's samples: the gradient of the mean loss over
        # the whole global batch (each node's loss is the mean over its own samples).
        strategy.mean_over_nodes_(grads, along=[flags], buckets=self.buckets)
        strategy.release_unused_grads(flags)


class DDP(Strategy):
    """Data parallel training: gradients averaged every step (the baseline).

    Equal to one node training on the union of the nodes' batches. Parameters that get no
    gradient on any node are left untouched, as torch DDP leaves them.
    """

    name = "ddp"
    display_name = "DDP"
    listing_order = 10
    continues_on_fewer_nodes = True  # the nodes are exact replicas (parameters and optimizer)
    elastic = True  # a joiner takes the replicas' state after any step
    replicas_in_sync = True
    balances = True  # its averages go through mean_over_nodes_ (engine/balance.py)
    supports_vmap = True

    def __init__(self, optim: str | Optim = "adamw", lr: float = 1e-3, **common: Any) -> None:
        super().__init__(optim, lr, modules=[GradientAveraging()], **common)
