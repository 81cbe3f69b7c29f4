"""Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512).

DiLoCo whose parameters are split into F fragments, each synced every H steps on its own
staggered schedule, so a sync moves about 1/F of the model (the peak bandwidth falls by
about F). Fragment p (0-based) starts a sync after step s when ``s + 1 = o_p + k * H``
(k >= 0), its offset being ``o_p = (p + 1) * H // F``: with F = 1 that is DiLoCo's
schedule, and the last fragment always syncs when DiLoCo would. A sync of fragment p::

    d = theta_p - theta_i,p                   # its outer gradient, ONE all-reduce (mean)
    ... tau more inner steps while the all-reduce runs ...
    theta_p = OuterSGD(theta_p, grad=mean(d))  # Nesterov, on every node's global copy
    theta_i,p = alpha * theta_i,p + (1 - alpha) * theta_p

The merge keeps a share alpha of the local fragment, which trained on during the tau
steps (alpha = 0 replaces it by the global one, torchft's default; the paper mixes with
alpha = 0.5 when it overlaps). With F = 1, tau = 0 and alpha = 0 it is DiLoCo, bit for bit.

Fragments are contiguous runs of parameter tensors in registration order with about equal
bytes (a cut falls where the running total comes nearest to k/F of the model): for a transformer
these are consecutive layer blocks (the paper's "sequential" pattern; it reports the
strided one slightly better), and for any model the peak bytes of a sync are about 1/F of
the whole, which is what the projection counts on.

At the end of training every sync still on its way is merged, then every fragment that
trained since its last sync (or merged with alpha > 0) syncs at once with alpha = 0, so
every node ends on the global model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from meshtrain.comm.communicator import BesideTraining, Pending
from meshtrain.comm.compression import PseudoGradientCompression
from meshtrain.strategies.base import CommunicationModule, Strategy
from meshtrain.strategies.diloco import OuterSGDStrategy


def split_fragments(sizes: Sequence[int], count: int) -> list[list[int]]:
    """Indices of ``sizes`` (bytes per tensor) cut into ``count`` contiguous non-empty runs
    of about equal bytes: cut k falls between the tensors where the running total comes
    nearest to k / count of the whole (the first such place on a tie)."""
    if not 1 <= count <= len(sizes):
        raise ValueError(f"fragments must be between 1 and the {len(sizes)} trainable parameter "
                         f"tensors of the model, got {count}")
    before = [0]  # bytes before tensor j
    for size in sizes:
        before.append(before[-1] + size)
    total = before[-1]
    cuts = [0]
    for k in range(1, count):
        # Each run keeps at least one tensor: the cut lies after the last one and leaves one
        # tensor for every run still to come.
        options = range(cuts[-1] + 1, len(sizes) - (count - k) + 1)
        cuts.append(min(options, key=lambda j: abs(before[j] * count - k * total)))
    cuts.append(len(sizes))
    return [list(range(start, end)) for start, end in zip(cuts, cuts[1:], strict=False)]


class StreamingOuterSync(CommunicationModule):
    """Streaming DiLoCo's outer loop: F fragments, each synced every H steps, staggered,
    its all-reduce overlapping the next ``tau`` inner steps."""

    def __init__(self, fragments: int, H: int, tau: int, alpha: float, outer_lr: float,
                 outer_momentum: float, nesterov: bool,
                 compressions: Sequence[PseudoGradientCompression | None] | None = None) -> None:
        if fragments < 1:
            raise ValueError(f"fragments must be >= 1, got {fragments}")
        if H < fragments:
            raise ValueError(f"H ({H}) must be >= fragments ({fragments}): each fragment syncs at "
                             "its own step of the H")
        if not 0 <= tau < H:
            raise ValueError(f"tau must be in [0, H) (a fragment merges before it syncs again), got {tau}")
        if not (math.isfinite(alpha) and 0 <= alpha <= 1):
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if not (math.isfinite(outer_lr) and outer_lr > 0):
            raise ValueError(f"outer_lr must be a finite number > 0, got {outer_lr}")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum}")
        self.count = fragments
        self.H = H
        self.tau = tau
        self.alpha = alpha
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.nesterov = nesterov
        #: Each fragment's compressed average (its own error-feedback residual), None: fp32.
        self.compressions = list(compressions) if compressions is not None else [None] * fragments
        #: Fragment p starts its syncs after the steps s with s + 1 = offsets[p] + k * H.
        self.offsets = [(p + 1) * H // fragments for p in range(fragments)]
        self.last_merge = -1  # the 0-based step a fragment's outer update last merged

    def setup(self, strategy: Strategy) -> None:
        super().setup(strategy)
        nodes = strategy.stacked_nodes or 1  # vmap: sizes per node
        self.fragments = split_fragments(
            [p.numel() // nodes * p.element_size() for p in strategy.params], self.count)
        # theta lives in its own storage: aliasing the worker's tensors would make delta 0.
        self.outer = [p.detach().clone() for p in strategy.params]
        self.outer_optimizer = torch.optim.SGD(
            self.outer, lr=self.outer_lr, momentum=self.outer_momentum,
            nesterov=self.nesterov and self.outer_momentum > 0,
        )
        self.beside = BesideTraining(strategy.comm)
        #: fragment -> (the step it merges after, its outer gradients, their all-reduce)
        self.in_flight: dict[int, tuple[int, list[torch.Tensor], Pending]] = {}
        self.last_start = [-1] * self.count
        self.last_merge = -1

    def in_flight_after(self, step: int) -> bool:
        """Whether a fragment's sync is on its way after 0-based ``step`` (started, not yet
        merged), by the schedule alone: the same answer on every node."""
        for offset in self.offsets:
            # The latest start at or before ``step``: it merges after start + tau.
            if step + 1 >= offset:
                start = step - (step + 1 - offset) % self.H
                if step < start + self.tau:
                    return True
        return False

    def admission_phase(self) -> int | None:
        """Where in every round of H steps an elastic run admits joiners: (step + 1) % H of
        the first step from the last fragment's merge on with no sync on its way (None:
        some sync is always on its way)."""
        for shift in range(self.H):
            phase = (self.tau + shift) % self.H
            # A step of the steady state (every fragment has started once) with this phase.
            if not self.in_flight_after(2 * self.H + phase - 1):
                return phase
        return None

    def fragment_bytes(self) -> list[int]:
        """Bytes of each fragment's outer gradient (per node)."""
        nodes = self.strategy.stacked_nodes or 1
        params = self.strategy.params
        return [sum(params[i].numel() // nodes * params[i].element_size() for i in f)
                for f in self.fragments]

    def after_optimizer_step(self, step: int) -> None:
        for p, offset in enumerate(self.offsets):
            if step + 1 >= offset and (step + 1 - offset) % self.H == 0:
                self.start(p, step)
        for p in sorted(self.in_flight):
            if self.in_flight[p][0] == step:
                self.merge(p, self.alpha, step)

    @torch.no_grad()
    def start(self, p: int, step: int) -> None:
        """Fragment p's outer gradient goes on the wire; it merges ``tau`` steps later."""
        indices = self.fragments[p]
        params = self.strategy.params
        deltas = [self.outer[i] - params[i] for i in indices]
        strategy, compression = self.strategy, self.compressions[p]
        pending = self.beside.start(
            lambda comm: strategy.mean_pseudo_gradients_(deltas, compression, comm=comm), self.tau)
        self.in_flight[p] = (step + self.tau, deltas, pending)
        self.last_start[p] = step

    @torch.no_grad()
    def merge(self, p: int, alpha: float, step: int) -> None:
        """Wait for fragment p's average, step its global copy, mix it into the local one."""
        _, averaged, pending = self.in_flight.pop(p)
        pending.wait()
        self.outer_step(self.fragments[p], averaged)
        self.mix(self.fragments[p], alpha)
        self.last_merge = step

    def outer_step(self, indices: list[int], averaged: list[torch.Tensor]) -> None:
        """theta = OuterSGD(theta, grad=averaged) on these tensors only (SGD skips the
        tensors without a gradient: each keeps its own momentum)."""
        for i, delta in zip(indices, averaged, strict=True):
            self.outer[i].grad = delta
        self.outer_optimizer.step()
        for i in indices:
            self.outer[i].grad = None

    def mix(self, indices: list[int], alpha: float) -> None:
        params = self.strategy.params
        for i in indices:
            params[i].mul_(alpha).add_(self.outer[i], alpha=1 - alpha)

    @torch.no_grad()
    def finish(self, step: int) -> bool:
        for p in sorted(self.in_flight):
            self.merge(p, self.alpha, step)
        # A fragment that started its sync at the last step and replaced its local copy is
        # already the global one on every node; every other one syncs now and is replaced.
        params = self.strategy.params
        for p in range(self.count):
            if self.last_start[p] == step and self.alpha == 0:
                continue
            indices = self.fragments[p]
            deltas = [self.outer[i] - params[i] for i in indices]
            self.strategy.mean_pseudo_gradients_(deltas, self.compressions[p])
            self.outer_step(indices, deltas)
            self.mix(indices, 0.0)
        self.last_merge = step  # every node now holds the global model
        return True

    def global_parameters(self) -> list[torch.Tensor]:
        return self.outer

    def last_synced(self) -> int | None:
        # A fragment's merge is as close as streaming comes to one global state mid-run.
        return self.last_merge + 1  # 0 before the first merge

    def synced(self, step: int) -> tuple[list[torch.Tensor], list[int] | None] | None:
        # The global copy is the same on every node; check it where a fragment merged.
        return (self.outer, None) if self.last_merge == step else None

    def state_dict(self) -> dict[str, Any]:
        # Syncs on their way are waited for (their averages are the same on every node) and
        # saved unmerged: a resumed run merges them at the same steps as an uninterrupted one.
        # First wait (an average is written in place), then copy.
        records = {p: pending.saved() for p, (_, _, pending) in self.in_flight.items()}
        return {
            "outer": [t.clone() for t in self.outer],
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "last_start": list(self.last_start),
            "in_flight": {p: (at, [t.clone() for t in averaged], records[p])
                          for p, (at, averaged, _) in self.in_flight.items()},
            # Error-feedback residuals are this node's own.
            "compression": [c.state_dict() if c is not None else None for c in self.compressions],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for theta, saved in zip(self.outer, state["outer"], strict=True):
            theta.copy_(saved)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.last_start = list(state["last_start"])
        comm = self.strategy.comm
        self.in_flight = {int(p): (int(at), [t.clone() for t in averaged], Pending.restored(comm, records))
                          for p, (at, averaged, records) in state["in_flight"].items()}
        for c, saved in zip(self.compressions, state.get("compression", []), strict=False):
            if c is not None and saved is not None:
                c.load_state_dict(saved)


class StreamingDiLoCo(OuterSGDStrategy):
    """Streaming DiLoCo: DiLoCo synced fragment by fragment, overlapped with training.

    Args:
        fragments: F, how many fragments the parameters are split into (each syncs every H
            steps, fragment p after steps (p + 1) * H // F + k * H).
        H: inner steps between two syncs of one fragment.
        tau: inner steps a fragment's all-reduce overlaps before its outer update merges
            (0: at once; the paper overlaps 1 to 5).
        alpha: the local fragment's share when the global one merges (0: replaced).
        outer_lr, outer_momentum, nesterov, optim, lr: see :class:`OuterSGDStrategy`.
        compression, compression_block, error_feedback: as DiLoCo's, per fragment (each
            keeps its own residual; the paper sends its outer gradients in 4 bits).
    """

    name = "streaming-diloco"
    display_name = "Streaming DiLoCo"
    listing_order = 70  # after the strategies of 2024
    key_parameters = {"fragments": "F", "H": "H", "tau": "tau"}
    balances = True  # its averages go through mean_over_nodes_ (engine/balance.py)
    supports_vmap = True
    elastic = True  # joiners come in once a round, where no fragment's sync is on its way

    def __init__(
        self,
        fragments: int = 4,
        H: int = 100,
        tau: int = 1,
        alpha: float = 0.5,
        **shared: Any,
    ) -> None:
        self.fragments = fragments
        self.H = H
        self.tau = tau
        self.alpha = alpha
        super().__init__(**shared)

    def admits_joiners_after(self, step: int) -> bool:
        # Once a round, after the last fragment's merge, where no sync is on its way: a
        # joiner takes every fragment's outer state and no average is half applied.
        sync = self.modules[0]
        assert isinstance(sync, StreamingOuterSync)
        phase = sync.admission_phase()
        return phase is not None and (step + 1) % self.H == phase and not sync.in_flight_after(step)

    def elastic_problem(self) -> str | None:
        sync = self.modules[0]
        assert isinstance(sync, StreamingOuterSync)
        if sync.admission_phase() is None:
            return (f"with fragments={self.fragments}, H={self.H} and tau={self.tau} a fragment's "
                    "sync is always on its way, so no step can admit a joiner: give a smaller tau "
                    "or fewer fragments")
        return None

    def outer_modules(self) -> list[CommunicationModule]:
        compressions = [self.new_compression() for _ in range(max(self.fragments, 0))]
        return [StreamingOuterSync(self.fragments, self.H, self.tau, self.alpha, self.outer_lr,
                                   self.outer_momentum, self.nesterov, compressions)]
