"""What every strategy shares: the local optimizer, the LR schedule, clipping, hooks.

A training step on a node is::

    loss.backward()                       # the trainer
    strategy.before_optimizer_step(step)  # e.g. average gradients (DDP)
    strategy.optimizer_step(step)         # clip, local optimizer step, zero grads
    strategy.after_optimizer_step(step)   # e.g. sync parameters (DiLoCo, SPARTA)

A strategy is built from :class:`CommunicationModule` pieces whose hooks run in
order, so "SPARTA + DiLoCo" is two modules on one strategy. A custom strategy
subclasses :class:`Strategy` and overrides a hook (see examples/custom_strategy.py).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from meshtrain.comm import Communicator
from meshtrain.comm.buckets import GradientBuckets
from meshtrain.comm.compression import PseudoGradientCompression

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}
LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class Optim:
    """An optimizer by name plus keyword arguments, e.g. ``Optim("adamw", weight_decay=0.1)``."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __init__(self, name: str, **kwargs: Any) -> None:
        if name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "kwargs", dict(kwargs))

    def build(self, params: Sequence[nn.Parameter], lr: float) -> torch.optim.Optimizer:
        kwargs = dict(self.kwargs)
        if not self.chooses_implementation and all(p.device.type == "cpu" for p in params):
            # On CPU torch steps one tensor at a time by default. Its list ("foreach")
            # kernels do the same arithmetic, bit for bit in float32 and float64
            # (tests/test_strategies.py), with one call per operation instead of one per
            # tensor: less Python per step, and fewer hand-offs of the interpreter lock
            # between node threads (threads runtime).
            kwargs["foreach"] = True
        return OPTIMIZERS[self.name](params, lr=lr, **kwargs)

    @property
    def chooses_implementation(self) -> bool:
        """Whether the options name torch's implementation (``foreach`` or ``fused``)."""
        return bool({"foreach", "fused"} & set(self.kwargs))

    def __repr__(self) -> str:
        args = "".join(f", {k}={v!r}" for k, v in self.kwargs.items())
        return f"Optim({self.name!r}{args})"


def as_optim(spec: str | Optim) -> Optim:
    """Accept ``"adamw"`` or an :class:`Optim`."""
    return spec if isinstance(spec, Optim) else Optim(spec)


class CommunicationModule:
    """One piece of communication a strategy is built from (hooks default to no-ops)."""

    def setup(self, strategy: Strategy) -> None:
        self.strategy = strategy

    def before_sole_backward(self, step: int) -> None:
        """Runs before the backward pass when it is the step's only one and the step
        follows it directly (see :meth:`Strategy.before_sole_backward`)."""

    def before_optimizer_step(self, step: int) -> None:
        """Runs after backward, before the local optimizer step (gradients are set)."""

    def after_optimizer_step(self, step: int) -> None:
        """Runs after the local optimizer step."""

    def finish(self, step: int) -> bool:
        """Runs once after the last step; return True if it left every node in sync."""
        return False

    def global_parameters(self) -> list[torch.Tensor] | None:
        """The global model's trainable parameters, if this module keeps them."""
        return None

    def last_synced(self) -> int | None:
        """Steps done when this module last brought the nodes to one global state (DiLoCo's
        outer sync, FedAvg's average): 0 before its first; None when it keeps no such step
        (the strategy then answers from its communication, see :meth:`Strategy.last_synced`)."""
        return None

    def synced(self, step: int) -> tuple[list[torch.Tensor], list[int] | None] | None:
        """If this module synced at ``step``: the tensors every member of the group (None:
        all nodes) now holds identically, for ``check_sync`` to verify."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Strategy:
    """Local training plus the communication modules that tie the nodes together.

    Args:
        optim: local optimizer, a name ("sgd", "adam", "adamw") or an :class:`Optim`.
        lr: peak learning rate of the local optimizer.
        max_norm: clip the gradient to this global norm before each local step.
        warmup_steps: linear warmup from 0 to ``lr``.
        lr_schedule: "constant" or "cosine" (from ``lr`` after warmup to ``min_lr`` at ``max_steps``).
        min_lr: floor of the cosine schedule.
    """

    name: ClassVar[str] = "custom"
    #: How tables and plot legends name it (default: ``name``).
    display_name: ClassVar[str | None] = None
    #: Where a built-in strategy is listed (``meshtrain strategies``, the registry's order).
    listing_order: ClassVar[int] = 100
    #: The parameters that tell its runs apart, each with its label (``DiLoCo H=25``).
    key_parameters: ClassVar[dict[str, str]] = {}
    #: True when every node holds the run's whole global state at a checkpoint, so a run
    #: can continue from it on fewer nodes (see :meth:`fewer_nodes_problem` for exceptions).
    continues_on_fewer_nodes: ClassVar[bool] = False
    #: True when ``launch --elastic`` can lose a node and take it back: at each admission
    #: point (:meth:`admits_joiners_after`) a healthy node's whole state is one a joiner can
    #: take (see :meth:`elastic_problem` for exceptions).
    elastic: ClassVar[bool] = False
    #: True when every node holds the same parameters after every step (DDP, DeMo).
    replicas_in_sync: ClassVar[bool] = False
    #: True where every average the strategy takes goes through :meth:`mean_over_nodes_`,
    #: so ``balance`` can weight it by samples; ``balance`` is refused otherwise (DeMo's
    #: update is the sign of a decoded sum; a custom strategy averaging by itself).
    balances: ClassVar[bool] = False
    #: Why ``balance`` is refused, in the strategy's own words (None: the general reason).
    balance_refusal: ClassVar[str | None] = None
    #: This node's samples per step under ``balance``, set by the training loop before step 0;
    #: None (the default): every node takes ``batch_size`` samples and means are plain means.
    sample_weight: float | None = None
    #: True when the strategy can drive every node at once in the vmap runtime. Setting it
    #: promises more than a flag: there ONE strategy object steps all nodes, so every tensor
    #: it touches (``self.params``, their ``.grad``, its own state) holds all nodes along
    #: dimension 0 (``[nodes, *shape]``, :attr:`stacked_nodes` of them); anything it computes
    #: per node (a norm, a scale, a flattened vector) must be computed per row; and every
    #: collective of ``self.comm`` reduces over that dimension, over all nodes (no groups).
    #: The vmap runtime tries one step on two stacked nodes before training and refuses,
    #: naming the strategy, one that fails (see docs/guides/custom-strategy.md). An instance
    #: whose options do not fit says why in :meth:`vmap_problem`.
    supports_vmap: ClassVar[bool] = False
    #: Set by the vmap runtime before :meth:`setup`: how many nodes the stacked tensors hold.
    stacked_nodes: int | None = None

    def __init__(
        self,
        optim: str | Optim = "adamw",
        lr: float = 1e-3,
        *,
        max_norm: float | None = None,
        warmup_steps: int = 0,
        lr_schedule: str = "constant",
        min_lr: float = 0.0,
        modules: Sequence[CommunicationModule] = (),
    ) -> None:
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {lr}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if not (math.isfinite(min_lr) and 0 <= min_lr <= lr):
            raise ValueError(f"min_lr must be between 0 and lr ({lr}), got {min_lr}")
        if lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {lr_schedule!r}")
        if max_norm is not None and max_norm <= 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        self.optim = as_optim(optim)
        self.lr = lr
        self.max_norm = max_norm
        self.warmup_steps = warmup_steps
        self.lr_schedule = lr_schedule
        self.min_lr = min_lr
        self.modules = list(modules)

    # ---------------------------------------------------------------- set-up
    def setup(
        self, model: nn.Module, comm: Communicator, *, seed: int, max_steps: int,
        num_samples: int = 0,
    ) -> None:
        """Bind to one node's model and communicator. Called once per node before step 0.

        ``num_samples`` is the size of this node's training data (FedAvg's weights).
        """
        self.model = model
        self.comm = comm
        self.seed = seed
        self.max_steps = max_steps
        self.num_samples = num_samples
        # Only trainable parameters are optimised and communicated (LoRA sends adapters only).
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = self.build_optimizer()
        for module in self.modules:
            module.setup(self)

    def check_nodes(self, nodes: int) -> None:
        """Raise ``ValueError`` when this strategy's settings do not fit a run of ``nodes``
        nodes (called before anything trains)."""

    def check_speeds(self, simulated: Sequence[float]) -> None:
        """Raise ``ValueError`` when the simulated nodes' speeds (1 / each ``--straggler``
        slowdown) do not fit this strategy's settings (called before anything trains)."""

    def use_node_speeds(self, simulated: Sequence[float] | None) -> None:
        """Called by the training loop after :meth:`setup`, before step 0: each node's speed
        relative to a normal node in a simulated run (1 / its ``--straggler`` slowdown), None
        on launched hosts. Strategies that schedule work by speed (async-diloco) use it."""

    def relative_work(self) -> dict[int, float] | None:
        """Each node's compute per loop step relative to one of its own steps, when the
        strategy spreads a slow node's steps over several loop steps (None: one step each);
        the projection counts a straggler's loop step as its slowdown times this."""
        return None

    def trains_at(self, step: int) -> bool:
        """Whether this node runs a training step (batch, forward, backward, update) at loop
        step ``step``; when False the loop skips them and calls :meth:`idle_step`."""
        return True

    def idle_step(self, step: int) -> None:
        """A loop step this node does not train in (:meth:`trains_at`): its syncs still run."""
        self.after_optimizer_step(step)

    def vmap_problem(self) -> str | None:
        """Why this instance cannot run in the vmap runtime although its class can, or None."""
        return None

    def build_optimizer(self) -> torch.optim.Optimizer | None:
        return self.optim.build(self.params, self.lr)

    # ------------------------------------------------------------------ step
    def lr_at(self, step: int) -> float:
        """Learning rate for ``step`` (0-based) under warmup and the schedule."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.lr_schedule == "cosine":
            span = max(1, self.max_steps - self.warmup_steps)
            progress = min(1.0, (step - self.warmup_steps) / span)
            return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))
        return self.lr

    def step(self, step: int) -> None:
        """Everything after backward for one training step."""
        self.before_optimizer_step(step)
        self.optimizer_step(step)
        self.after_optimizer_step(step)

    def skip_step(self, step: int) -> None:
        """Drop this step's gradients without updating (a non-finite loss somewhere, with
        ``skip_nonfinite``); syncs due after the step still happen on schedule."""
        for p in self.params:
            p.grad = None
        self.after_optimizer_step(step)

    def before_sole_backward(self, step: int) -> None:
        """Called by the loop before a step's backward pass when it is the step's only one
        and nothing changes the gradients between it and :meth:`step` (no microbatches,
        fp16 unscaling, non-finite skipping or recomputation): a module may then start
        communicating gradients while the backward pass runs."""
        for module in self.modules:
            module.before_sole_backward(step)

    def before_optimizer_step(self, step: int) -> None:
        for module in self.modules:
            module.before_optimizer_step(step)

    def optimizer_step(self, step: int) -> None:
        assert self.optimizer is not None
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(step)
        if self.max_norm is not None and self.stacked_nodes is not None:
            _clip_each_node_(self.params, self.max_norm, self.stacked_nodes)
        elif self.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def after_optimizer_step(self, step: int) -> None:
        for module in self.modules:
            module.after_optimizer_step(step)

    def finish(self, step: int) -> None:
        """After the last step: final syncs, so every node ends holding the global model."""
        in_sync = self.replicas_in_sync
        for module in self.modules:
            in_sync = module.finish(step) or in_sync
        if not in_sync:
            # Nodes still differ (SPARTA): one last full average produces the global model.
            self.mean_over_nodes_(self.params_data())

    def synced(self, step: int) -> tuple[list[torch.Tensor], list[int] | None] | None:
        """What this strategy promises is identical across nodes after ``step`` (or None):
        every parameter for replicas kept in sync (DDP, DeMo), else what a module synced."""
        if self.replicas_in_sync:
            return self.params_data(), None
        for module in self.modules:
            promised = module.synced(step)
            if promised is not None:
                return promised
        return None

    def last_synced(self) -> int | None:
        """Steps done when this strategy last synchronised the nodes (the live view's "last
        sync"), or None before the first sync.

        A module that keeps its sync step answers (the latest, if several do: SPARTA+DiLoCo's
        is DiLoCo's outer sync). Otherwise the answer is the last step in which this node
        took part in a recorded collective: every step for DDP, DeMo and SPARTA, and a
        correct default for a strategy that says nothing (start-up traffic, step -1, and
        unrecorded collectives such as a validation mean do not count). Override it when
        a strategy communicates without synchronising.
        """
        kept = [done for done in (m.last_synced() for m in self.modules) if done is not None]
        if kept:
            return max(kept) or None
        comm = getattr(self, "comm", None)  # None before setup
        records = comm.log.records if comm is not None else []
        return records[-1].step + 1 if records and records[-1].step >= 0 else None

    # ------------------------------------------------------------- averaging
    @torch.no_grad()
    def mean_over_nodes_(self, tensors: Sequence[torch.Tensor], *, group: list[int] | None = None,
                         record: bool = True, along: Sequence[torch.Tensor] = (),
                         buckets: GradientBuckets | None = None,
                         comm: Communicator | None = None) -> None:
        """Replace ``tensors`` in place by their mean over ``group`` (None: every alive node).

        Without :attr:`sample_weight` it is the plain mean: one all-reduce (mean) of
        ``[*tensors, *along]``, exactly as strategies averaged before ``balance`` existed.
        With it (``balance``), it is the sample-weighted mean ``sum_i w_i x_i / sum_i w_i``
        over the group, ``w_i`` being node i's samples per step: still ONE all-reduce, of
        ``[w_i x_i ..., *along, w_i]`` (sum), then a division by the summed weight. ``along``
        rides in the same bucket (DDP's has-gradient flags): averaged in the plain case,
        summed in the weighted one; either keeps 0 exactly where every node sent 0.

        With ``buckets`` (one tensor per parameter: DDP's gradients) the all-reduce is
        that of :class:`~meshtrain.comm.buckets.GradientBuckets`, ``along`` and the
        weight riding in its last bucket.

        ``comm``: the communicator to reduce over (default :attr:`comm`; a side channel's
        for work that runs beside training, :class:`~meshtrain.comm.communicator.BesideTraining`).
        """
        comm = comm if comm is not None else self.comm
        weight = self.sample_weight
        if weight is None:
            if buckets is not None:
                buckets.all_reduce_(tensors, op="mean", along=along, group=group, record=record)
            else:
                comm.all_reduce([*tensors, *along], op="mean", group=group, record=record)
            return
        like = tensors[0] if tensors else torch.zeros(())
        total = torch.tensor([float(weight)], dtype=like.dtype, device=like.device)
        if buckets is not None:  # it multiplies each tensor by the weight as it fills a bucket
            buckets.all_reduce_(tensors, op="sum", scale=weight, along=[*along, total], group=group,
                                record=record)
        else:
            for t in tensors:
                t.mul_(weight)
            comm.all_reduce([*tensors, *along, total], op="sum", group=group, record=record)
        for t in tensors:
            t.div_(total)

    @torch.no_grad()
    def mean_pseudo_gradients_(self, tensors: Sequence[torch.Tensor],
                               compression: PseudoGradientCompression | None, *,
                               group: list[int] | None = None, record: bool = True,
                               weight: float | None = None,
                               comm: Communicator | None = None) -> None:
        """Replace pseudo-gradients (outer gradients, round deltas) in place by their mean over
        ``group``: :meth:`mean_over_nodes_` without ``compression`` (fp32, bit for bit as
        before), else the compressed all-gather of
        :class:`~meshtrain.comm.compression.PseudoGradientCompression` (sample-weighted under
        ``balance`` as well, or by ``weight`` when given: FedAvg's sample counts). Every
        strategy that averages pseudo-gradients goes through here. ``comm``: the communicator
        to reduce over (default :attr:`comm`; a side channel's for work that runs beside
        training, :class:`~meshtrain.comm.communicator.BesideTraining`)."""
        if compression is None:
            self.mean_over_nodes_(tensors, group=group, record=record, comm=comm)
            return
        if self.sample_weight is not None:
            weight = self.sample_weight
        compression.mean_(comm if comm is not None else self.comm, tensors, group=group, weight=weight,
                          stacked_nodes=self.stacked_nodes, record=record)

    # --------------------------------------------------------------- queries
    def params_data(self) -> list[torch.Tensor]:
        return [p.data for p in self.params]

    def grads(self) -> list[torch.Tensor]:
        """Gradients of the trainable parameters, for a strategy to communicate.

        A parameter that got no gradient on this node gets a zero placeholder (every node
        sends the same shapes; a missing gradient counts as zero in an average, as in torch
        DDP), and :attr:`grad_flags` records which gradients were real: 1 per parameter
        that had one here, 0 otherwise (in the gradients' dtype). Combine the flags over the
        nodes along with the gradients (mean, sum or max) and pass them to
        :meth:`release_unused_grads`: a parameter with no gradient on ANY node then keeps
        ``grad = None`` and the optimizer leaves it untouched (weight decay included), as
        plain torch and torch DDP do.
        """
        like = self.params[0] if self.params else torch.zeros(())
        self.grad_flags = torch.tensor(
            [p.grad is not None for p in self.params], dtype=like.dtype, device=like.device
        )
        if self.stacked_nodes is not None:  # every node's flags, one row each
            self.grad_flags = self.grad_flags.expand(self.stacked_nodes, -1).clone()
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params]  # type: ignore[misc]

    def release_unused_grads(self, flags: torch.Tensor) -> None:
        """Drop the placeholder gradient of every parameter whose combined flag is 0.

        ``flags`` is :attr:`grad_flags` reduced over the nodes (any op that keeps 0 only
        where every node sent 0); every node gets the same flags, so replicas stay equal.
        """
        if self.stacked_nodes is not None:  # reduced over the nodes: every row is the same
            flags = flags[0]
        for p, used in zip(self.params, flags.tolist(), strict=True):
            if used == 0:
                p.grad = None

    def global_parameters(self) -> list[torch.Tensor]:
        """The global model's trainable parameters now (for evaluation mid-training).

        Modules that keep them (DiLoCo's outer parameters) answer first; replicas in sync
        use their own; otherwise the mean of the nodes, through an unrecorded collective
        (it is a measurement, not part of training).
        """
        for module in reversed(self.modules):
            kept = module.global_parameters()
            if kept is not None:
                return kept
        if self.replicas_in_sync:
            return self.params_data()
        averaged = [p.detach().clone() for p in self.params]
        self.mean_over_nodes_(averaged, record=False)
        return averaged

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """All strategy state of this node: optimizer and module buffers."""
        return {
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "modules": [m.state_dict() for m in self.modules],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        for module, module_state in zip(self.modules, state["modules"], strict=True):
            module.load_state_dict(module_state)

    @classmethod
    def parameters(cls) -> dict[str, inspect.Parameter]:
        """Constructor parameters by name (what `meshtrain strategies` lists and --set sets).

        Subclasses list their own parameters and pass the shared ones (optim, lr, ...)
        through ``**common``; this merges both, the subclass's first.
        """
        found: dict[str, inspect.Parameter] = {}
        for klass in cls.__mro__:
            if not (isinstance(klass, type) and issubclass(klass, Strategy)):
                continue
            if "__init__" not in vars(klass):
                continue
            for n, p in inspect.signature(klass.__init__).parameters.items():
                if n in ("self", "modules") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                    continue
                found.setdefault(n, p)
        return found

    def sync_interval(self) -> int | None:
        """Steps between the syncs after which every node holds the global state (DiLoCo's
        and FedAvg's H): checkpoints are rounded up to a multiple of it. None: no such rhythm."""
        return None

    def admits_joiners_after(self, step: int) -> bool:
        """Whether an elastic run may admit joiners after 0-based ``step`` (the same answer on
        every node): after each sync that leaves every node with the global state (DiLoCo's
        and FedAvg's H), after every step where there is no such rhythm (DDP)."""
        return (step + 1) % (self.sync_interval() or 1) == 0

    def elastic_problem(self) -> str | None:
        """Why ``launch --elastic`` cannot run this instance, or None."""
        if not self.elastic:
            return "its nodes never hold one global state that a joiner could take"
        return self.fewer_nodes_problem()

    def fewer_nodes_problem(self) -> str | None:
        """Why this instance's checkpoint cannot continue on fewer nodes although its class
        can (FedAvg with islands), or None."""
        return None

    def config(self) -> dict[str, Any]:
        """Constructor arguments (each stored under its own name), for config.yaml."""
        values = {}
        for n in self.parameters():
            v = getattr(self, n)
            values[n] = {"name": v.name, **v.kwargs} if isinstance(v, Optim) else v
        return {"name": self.name, **values}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.parameters())
        return f"{type(self).__name__}({args})"


@torch.no_grad()
def _clip_each_node_(stacked: Sequence[torch.Tensor], max_norm: float, nodes: int) -> None:
    """``clip_grad_norm_`` of each node's own gradients (row ``i`` of every stacked tensor):
    the same norm, coefficient and clamping as torch's, per node."""
    grads = [p.grad for p in stacked if p.grad is not None]
    if not grads:
        return
    squares = torch.stack([g.reshape(nodes, -1).pow(2).sum(dim=1) for g in grads]).sum(dim=0)
    coef = (max_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.view(nodes, *([1] * (g.dim() - 1))))
