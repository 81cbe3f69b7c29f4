"""FedAvg / local SGD (McMahan et al. 2017), optionally within random islands.

Every H steps the nodes average their parameters. With ``island_size`` they are
split each round into random groups that average only among themselves (group-sized
traffic); the split comes from a generator seeded by (run seed, round), so every
node computes the same one and nothing is broadcast.

With ``weighted=True`` every average, inside an island or over all nodes, is the
sample-weighted mean ``sum_i n_i theta_i / sum_i n_i`` of McMahan et al., and so is
the global model: the final sync after the last step (a full average over all nodes
when islands leave them apart) and the model evaluated between syncs.

Under ``balance`` the weight of node i is instead its samples per step b_i (the samples
it saw in the round are H * b_i), ``weighted`` or not: every node's shard is the same
size then, and what differs is how much of it each node trained on.
"""

from __future__ import annotations

from typing import Any

import torch

from meshtrain.comm.compression import PseudoGradientCompression, compression_from
from meshtrain.seeding import seeded_generator
from meshtrain.strategies.base import CommunicationModule, Optim, Strategy


class ModelAveraging(CommunicationModule):
    """Average parameters every ``H`` steps, globally or within seeded islands."""

    def __init__(self, H: int, island_size: int | None, weighted: bool,
                 compression: PseudoGradientCompression | None = None) -> None:
        if H < 1:
            raise ValueError(f"H must be >= 1, got {H}")
        if island_size is not None and island_size < 2:
            raise ValueError(f"island_size must be >= 2 (or None), got {island_size}")
        self.H = H
        self.island_size = island_size
        self.weighted = weighted
        self.compression = compression
        self.last_average = -1
        self.last_group: list[int] | None = None

    def setup(self, strategy: Strategy) -> None:
        super().setup(strategy)
        # Compressed rounds send the round's delta from the last average (its anchor), not
        # the parameters: quantising the parameters themselves would lose far more.
        self.anchor = ([p.detach().clone() for p in strategy.params]
                       if self.compression is not None else [])

    def islands(self, sync_round: int) -> list[list[int]]:
        """The groups of ``sync_round``: a seeded shuffle cut into island_size pieces."""
        n = self.strategy.comm.world_size
        if self.island_size is None or self.island_size >= n:
            return [list(range(n))]
        order = torch.randperm(n, generator=seeded_generator(self.strategy.seed, sync_round)).tolist()
        return [sorted(order[i : i + self.island_size]) for i in range(0, n, self.island_size)]

    def my_island(self, sync_round: int) -> list[int]:
        rank = self.strategy.comm.rank
        return next(g for g in self.islands(sync_round) if rank in g)

    @torch.no_grad()
    def averaged(
        self, params: list[torch.Tensor], group: list[int] | None, *, record: bool = True
    ) -> None:
        """Replace ``params`` in place by their (weighted) mean over ``group``: one all-reduce."""
        comm = self.strategy.comm
        if self.strategy.sample_weight is not None:  # balance: weighted by samples per step
            self.strategy.mean_over_nodes_(params, group=group, record=record)
            return
        if not self.weighted:
            comm.all_reduce(params, op="mean", group=group, record=record)
            return
        # One bucket: [w * theta_i ..., w]; sum, then divide by the total weight.
        weight = float(max(1, self.strategy.num_samples))
        first = params[0]
        buffers = [p * weight for p in params]
        buffers.append(torch.tensor([weight], dtype=first.dtype, device=first.device))
        comm.all_reduce(buffers, op="sum", group=group, record=record)
        total = buffers[-1]
        for p, b in zip(params, buffers[:-1], strict=True):
            p.copy_(b / total)

    @torch.no_grad()
    def compressed_average(self, group: list[int] | None) -> None:
        """theta = anchor - mean_i(anchor - theta_i), the mean through the compressed all-gather."""
        params = self.strategy.params_data()
        deltas = [a - p for a, p in zip(self.anchor, params, strict=True)]
        weight = float(max(1, self.strategy.num_samples)) if self.weighted else None
        self.strategy.mean_pseudo_gradients_(deltas, self.compression, group=group, weight=weight)
        for a, p, d in zip(self.anchor, params, deltas, strict=True):
            p.copy_(a - d)
            a.copy_(p)

    def average(self, step: int, group: list[int] | None) -> None:
        if self.compression is not None:
            self.compressed_average(group)
        else:
            self.averaged(self.strategy.params_data(), group)
        self.last_average, self.last_group = step, group

    def last_synced(self) -> int | None:
        # An island round counts: its nodes agree among themselves (the island is the group).
        return self.last_average + 1  # 0 before the first average

    def synced(self, step: int) -> tuple[list[torch.Tensor], list[int] | None] | None:
        if self.last_average != step:
            return None
        return self.strategy.params_data(), self.last_group

    def after_optimizer_step(self, step: int) -> None:
        if (step + 1) % self.H == 0:
            self.average(step, self.my_island(step // self.H))

    def _islands_apart(self) -> bool:
        """True when rounds average inside islands smaller than the whole cluster."""
        return self.island_size is not None and self.island_size < self.strategy.comm.world_size

    def finish(self, step: int) -> bool:
        # The global model is the (weighted) mean over ALL nodes: after island rounds the
        # nodes still differ, so one full average follows even if a round just ended.
        if self._islands_apart() or self.last_average != step:
            self.average(step, None)
        return True

    def global_parameters(self) -> list[torch.Tensor] | None:
        """The global model between syncs: the weighted mean when weighted (unrecorded)."""
        if not self.weighted:
            return None  # the strategy's mean of the nodes (sample-weighted under balance)
        params = [p.detach().clone() for p in self.strategy.params]
        self.averaged(params, None, record=False)
        return params

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"last_average": self.last_average}
        if self.compression is not None:
            state["anchor"] = [a.clone() for a in self.anchor]
            state["compression"] = self.compression.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_average = state["last_average"]
        if self.compression is not None and "anchor" in state:
            for a, saved in zip(self.anchor, state["anchor"], strict=True):
                a.copy_(saved)
            self.compression.load_state_dict(state.get("compression", {}))


class FedAvg(Strategy):
    """Local SGD with parameter averaging every H steps.

    Args:
        H: local steps between averages (H=1 with SGD and equal shards is DDP).
        island_size: average within random groups of this size each round; after the
            last step one full average over all nodes gives the global model.
        weighted: weight each node by its number of training samples (McMahan et al.),
            in every average including the final one.
        compression, compression_block, error_feedback: as DiLoCo's: with a codec other
            than fp32 each round averages the delta from the last average (the round's
            pseudo-gradient) through the compressed all-gather; not with islands.
    """

    name = "fedavg"
    display_name = "FedAvg"
    listing_order = 50
    key_parameters = {"H": "H", "island_size": "islands"}
    continues_on_fewer_nodes = True  # after a full average every node holds the global model
    elastic = True  # with islands too: see elastic_problem
    balances = True  # its averages go through mean_over_nodes_ (engine/balance.py)
    supports_vmap = True  # without islands or weights: see vmap_problem

    def __init__(
        self,
        H: int = 1,
        island_size: int | None = None,
        weighted: bool = False,
        compression: str = "fp32",
        compression_block: int = 128,
        error_feedback: bool = False,
        optim: str | Optim = "sgd",
        lr: float = 0.05,
        **common: Any,
    ) -> None:
        self.H = H
        self.island_size = island_size
        self.weighted = weighted
        self.compression = compression
        self.compression_block = compression_block
        self.error_feedback = error_feedback
        codec = compression_from(compression, compression_block, error_feedback)
        if codec is not None and island_size is not None:
            # A node's anchor is its last island's average: members of a new island start
            # from different anchors, so their deltas do not share an origin.
            raise ValueError(f"compression={compression} does not combine with island_size: "
                             "islands average parameters, not deltas from a shared origin")
        super().__init__(
            optim, lr, modules=[ModelAveraging(H, island_size, weighted, codec)], **common
        )

    def sync_interval(self) -> int | None:
        return self.H

    def fewer_nodes_problem(self) -> str | None:
        if self.island_size is None:
            return None
        return (f"strategy fedavg with island_size={self.island_size}: between full "
                "averages the nodes differ, so a lost node takes its part of the global model with it")

    def elastic_problem(self) -> str | None:
        # Islands too: a lost node's island goes on without it (the communicator's groups
        # drop departed ranks), and a joiner takes a healthy node's state at a round's end,
        # as every node of an island round holds its island's average.
        return None

    def vmap_problem(self) -> str | None:
        # In the vmap runtime one call reduces over every node: islands (a different group
        # per node) and per-node sample weights do not fit that.
        if self.island_size is not None:
            return f"strategy fedavg with island_size={self.island_size} averages within islands"
        if self.weighted:
            return "strategy fedavg with weighted=true weights every node by its own sample count"
        return None

    def check_nodes(self, nodes: int) -> None:
        # An island larger than the cluster is no island at all: a mistake, not a setting.
        if self.island_size is not None and self.island_size > nodes:
            raise ValueError(f"island_size={self.island_size} exceeds the {nodes} nodes: give at "
                             f"most {nodes}, or drop island_size to average all nodes")

    def uneven_islands(self, nodes: int) -> str | None:
        """What happens when ``island_size`` does not divide ``nodes`` (None when it does)."""
        if self.island_size is None or self.island_size >= nodes or nodes % self.island_size == 0:
            return None
        rest = nodes % self.island_size
        alone = " (that node averages with no one that round)" if rest == 1 else ""
        return (f"island_size={self.island_size} does not divide the {nodes} nodes: each round has "
                f"{nodes // self.island_size} island(s) of {self.island_size} and one of {rest}{alone}")
