"""Every node in one vectorised computation: parameters stacked along a node dimension.

For many simulated nodes of a small model, the threads runtime spends its time on N small
kernels and N Python loops per step. Here the trainable parameters of all nodes are one
tensor each, ``[nodes, *shape]``; one ``torch.func.vmap(grad_and_value(...))`` call computes
every node's loss and gradients on every node's own batch, one optimizer steps all nodes at
once (torch's SGD, Adam and AdamW are element-wise, so a stacked tensor steps exactly as N
separate ones), and the collectives are reductions over the node dimension
(:class:`~meshtrain.comm.stacked.StackedCommunicator`, with the threads runtime's byte
accounting, node by node).

It has its own training loop (this module's :func:`run_vmap`): one strategy object drives
all nodes, so the per-node loop of :mod:`meshtrain.engine.loop` does not fit. It shares the
strategies, the Communicator interface, the data streams and the run directory (history,
summary and projection are built by the same functions as the threads runtime's).

Results equal the threads runtime's within float tolerance, not bit for bit: batched
kernels and a reduction over a dimension add in other orders than N separate kernels and
the ring. Frozen parameters (LoRA's base) and buffers are held once and shared by every node.

``precision`` bf16 autocasts the vectorised forward pass as the threads runtime autocasts
each node's. A NaN or infinite loss or gradient stops the run at its step, naming the first
node it is on (:class:`~meshtrain.engine.job.NodeFailed`, as the other runtimes raise).

Refused before anything trains (:func:`vmap_refusal`): strategies that do not declare
``supports_vmap``, or whose step fails on stacked parameters (tried once on two nodes);
models with running statistics (batch norm) or that torch.func cannot transform;
checkpoints, resuming, simulated faults, loggers, ``skip_nonfinite``, gradient
checkpointing and fp16 (its loss scaling).
"""

from __future__ import annotations

import copy
import math
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import TensorDataset

from meshtrain import observers
from meshtrain.cluster import get_cluster, project
from meshtrain.comm.stacked import StackedCommunicator
from meshtrain.data import NodeBatches, fetch, resolve_dataset, split_microbatches, to_device
from meshtrain.devices import resolve_device
from meshtrain.engine import memory
from meshtrain.engine.callbacks import (
    NonFiniteLoss,
    ReplicaDrift,
    _batch_len,
    _validation_batches,
    mean_loss,
    node_replica,
)
from meshtrain.engine.job import FitResult, NodeFailed, NodeJob
from meshtrain.engine.loop import node_seed, sole_backward
from meshtrain.engine.report import NodeReport, add_projected_seconds, history_rows, run_summary, write_run
from meshtrain.errors import InputError
from meshtrain.progress import Progress
from meshtrain.strategies import Strategy

#: Settings the vmap runtime cannot honour, each with why (refused before training).
UNSUPPORTED_SETTINGS: dict[str, str] = {
    "checkpoint_every": "checkpoints are written by the threads and processes runtimes only",
    "resume": "a run resumes in the threads or processes runtime",
    "fail": "simulated faults (--fail) need the threads or processes runtime",
    "straggler": "simulated faults (--straggler) need the threads or processes runtime",
    "skip_nonfinite": "skipping non-finite steps needs the threads or processes runtime",
    "wandb": "loggers (wandb) need the threads or processes runtime",
    "tensorboard": "loggers (tensorboard) need the threads or processes runtime",
    # Per-node sample shares (main's balance): a weight per node, not one per call.
    "balance": "balance gives each node its own samples per step; use the threads runtime",
    # torch.utils.checkpoint's recomputation is not a transform torch.func composes with here,
    # and the setting would otherwise be accepted and silently not applied.
    "gradient_checkpointing": "recomputing activations needs the threads or processes runtime",
}

#: Precisions the vmap runtime cannot apply, each with why (bf16 and fp32 it applies).
UNSUPPORTED_PRECISIONS: dict[str, str] = {
    "fp16": "loss scaling (an overflow vote that skips the step on every node) needs the threads "
            "or processes runtime",
}


def vmap_refusal(strategy: Strategy, config: Any, model: nn.Module, train_data: Any,
                 collate_fn: Any) -> str | None:
    """Why a run cannot use the vmap runtime (one line), or None when it can.

    The model is tried once, on two nodes of one sample each, so a model torch.func cannot
    transform is refused here rather than at the first step.
    """
    if not strategy.supports_vmap:
        return (f"strategy {strategy.name} does not support the vmap runtime (supports_vmap is "
                "False); use --runtime threads")
    problem = strategy.vmap_problem()
    if problem:
        return f"{problem}, which the vmap runtime cannot do; use --runtime threads"
    for name, why in UNSUPPORTED_SETTINGS.items():
        if getattr(config, name, None):  # a setting this build does not have is not set
            return f"setting {name}: {why}"
    if config.precision in UNSUPPORTED_PRECISIONS:
        return f"setting precision {config.precision}: {UNSUPPORTED_PRECISIONS[config.precision]}"
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            return (f"model {type(model).__name__} keeps running statistics in "
                    f"{type(module).__name__}, which each node would update on its own; "
                    "use --runtime threads")
    if not any(p.requires_grad for p in model.parameters()):
        return f"model {type(model).__name__} has no trainable parameters"
    return _trial_problem(strategy, model, train_data, collate_fn, config)


#: What a strategy that sets ``supports_vmap`` must do (the refusal's and the docs' words).
VMAP_CONTRACT = ("under vmap every tensor it touches holds all nodes along dimension 0 "
                 "([nodes, *shape], self.stacked_nodes of them) and every collective reduces "
                 "over that dimension")


def _trial_problem(strategy: Strategy, model: nn.Module, train_data: Any, collate_fn: Any,
                   config: Any) -> str | None:
    """Run the vectorised loss and gradient once on two nodes, then one step of the strategy
    on them and its final sync; say what fails, if anything."""
    data, _ = resolve_dataset(train_data, 0, 1, "train")
    device = resolve_device(config.device)
    replica = node_replica(model, device)
    names = [n for n, p in replica.named_parameters() if p.requires_grad]
    own = dict(replica.named_parameters())
    holder = _StackedParameters(names, [own[n].detach().unsqueeze(0).expand(2, *own[n].shape).clone()
                                        for n in names])
    one = to_device(fetch(data, [0], collate_fn), device)
    try:
        batch = _stack_batches([one, one])
        with NodeRandomness([0, 1], device), memory.autocast(config.precision, device):
            losses = _loss_function(replica, 0)(holder.by_name(), batch)
        losses.sum().backward()
    except Exception as exc:  # noqa: BLE001 - any failure is a reason to refuse
        return (f"model {type(model).__name__} cannot run under torch.func.vmap "
                f"({_first_line(exc)}); use --runtime threads")
    # A strategy written for one node's tensors (a flattened gradient, a norm over all of a
    # tensor) fails here, or at step 1 as a raw RuntimeError about tensor dimensions.
    trial = copy.deepcopy(strategy)
    trial.stacked_nodes = 2
    try:
        trial.setup(holder, StackedCommunicator(2), seed=config.seed, max_steps=2, num_samples=1)
        trial.step(0)
        trial.finish(0)  # the final sync: what a strategy does every H steps, done once here
        shapes = [tuple(t.shape) for t in trial.params_data()]
        expected = [tuple(t.shape) for t in holder.stacked]
        if shapes != expected:
            raise RuntimeError(f"its parameters came out shaped {shapes[:1]}, not {expected[:1]}")
    except Exception as exc:  # noqa: BLE001 - any failure is a reason to refuse
        return (f"strategy {strategy.name} sets supports_vmap = True but its step fails on stacked "
                f"parameters ({_first_line(exc)}): {VMAP_CONTRACT}; use --runtime threads")
    return None


def _first_line(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _loss_function(model: nn.Module, batch_dim: int | None,
                   randomness: str = "different") -> Callable[..., torch.Tensor]:
    """``f(stacked trainable parameters, batch) -> losses``, one per node, differentiable.

    ``batch_dim`` 0: every node reads its own row of a stacked batch; None: all read the
    same batch. Frozen parameters and buffers are not stacked: every node reads the same
    ones. ``randomness`` is vmap's: "different" (run it under :class:`NodeRandomness` to
    draw from each node's own stream) or "error" (a model that draws nothing).
    """
    shared = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    shared.update(dict(model.named_buffers()))

    def node_loss(trainable: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
        return functional_call(model, (trainable, shared), (batch,))

    losses = vmap(node_loss, in_dims=(0, batch_dim), randomness=randomness)

    def call(trainable: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
        # Fused attention kernels have no batching rule (vmap would loop over the nodes);
        # the math kernel is plain batched matrix products.
        with sdpa_kernel([SDPBackend.MATH]):
            return losses(trainable, batch)

    return call


def _node_batches(streams: list[tuple[Any, NodeBatches]], indices: tuple[list[int], ...],
                  collate_fn: Any) -> Any:
    """Every node's batch of ``indices``, stacked: one gather when the nodes share one
    TensorDataset (what the threads runtime's nodes each fetch, in one indexing)."""
    data = streams[0][0]
    if collate_fn is None and isinstance(data, TensorDataset) and all(d is data for d, _ in streams):
        idx = torch.as_tensor(indices)
        return tuple(t[idx] for t in data.tensors)
    return _stack_batches([fetch(d, ix, collate_fn) for (d, _), ix in zip(streams, indices, strict=True)])


def _stack_batches(batches: list[Any]) -> Any:
    """One batch whose every tensor has the nodes along a new dimension 0."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(batches)
    if isinstance(first, dict):
        return {k: _stack_batches([b[k] for b in batches]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(_stack_batches(list(parts)) for parts in zip(*batches, strict=True))
    raise TypeError(f"the vmap runtime stacks batches of tensors, tuples, lists and dicts; "
                    f"got {type(first).__name__}")


class _StackedParameters(nn.Module):
    """The trainable parameters of every node, one ``[nodes, *shape]`` tensor each: what the
    strategy binds to (its ``params`` are these, in the model's order)."""

    def __init__(self, names: list[str], stacked: list[torch.Tensor]) -> None:
        super().__init__()
        self.names = names
        self.stacked = nn.ParameterList(nn.Parameter(t, requires_grad=True) for t in stacked)

    def by_name(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.stacked, strict=True))


class RandomnessUnsupported(InputError):
    """A random draw inside the vectorised forward that no node stream can give: the model
    cannot run in the vmap runtime (found by the trial step before training)."""


class NodeRandomness(TorchDispatchMode):
    """Each node's random numbers from its own stream, as the threads runtime gives them.

    Under ``vmap(randomness="different")`` a dropout mask of all nodes is one draw
    (``aten.bernoulli.p``) on a tensor with the nodes along dimension 0. This mode, active
    around the vectorised forward, draws row ``i`` from node ``i``'s generator instead,
    seeded as the threads runtime seeds node ``i`` (:func:`node_seed`): the same op on the
    same shape from the same state, so the masks are the threads runtime's, bit for bit.
    Any other random op is refused (:class:`RandomnessUnsupported`). torch's global
    generator is never touched. :attr:`drew` tells whether anything was drawn. The
    generators live on the computation's ``device`` (a CUDA draw needs a CUDA generator;
    there each node's masks are its own and reproducible, but not the CPU's). When the
    nodes are computed a chunk at a time, :attr:`active` holds the chunk's generators.
    """

    def __init__(self, seeds: list[int], device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
        self.active = self.generators
        self.drew = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        self.drew = True
        nodes = len(self.active)
        if func is torch.ops.aten.bernoulli.p and kwargs.get("generator") is None \
                and args[0].dim() > 0 and args[0].shape[0] == nodes:
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            out = torch.empty_like(args[0])
            for row, generator in zip(out, self.active, strict=True):
                row.bernoulli_(p, generator=generator)
            return out
        raise RandomnessUnsupported(f"{func} draws random numbers that the vmap runtime cannot "
                                    "take from each node's own stream (it can: dropout)")


def run_vmap(job: NodeJob) -> FitResult:
    """Train every node of ``job`` in one vectorised computation."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(job.config.threads or 1)
    try:
        return _train(job)
    finally:
        torch.set_num_threads(threads_before)


def _train(job: NodeJob) -> FitResult:
    cfg = job.config
    nodes = cfg.nodes
    device = resolve_device(cfg.device)
    model = node_replica(job.model, device)
    model.train()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    own = dict(model.named_parameters())
    holder = _StackedParameters(
        names, [own[n].detach().unsqueeze(0).expand(nodes, *own[n].shape).clone() for n in names])
    comm = StackedCommunicator(nodes)
    streams = _node_streams(job)
    comm.step = -1
    max_steps = cfg.steps or min(max(1, math.ceil(cfg.epochs * len(b))) for _, b in streams)  # type: ignore[operator]
    strategy = _bound_strategy(job, holder, comm, max_steps, len(streams[0][1].indices))
    startup_sent = [log.bytes_sent for log in comm.logs]

    # Every node's random stream, as in the threads runtime. The first step shows whether
    # the model draws at all; a model that does not then runs without the mode (and a
    # draw after all would fail loudly, never come from a shared stream).
    randomness: NodeRandomness | None = NodeRandomness([node_seed(cfg.seed, r) for r in range(nodes)],
                                                       device)
    node_losses = _loss_function(model, 0)
    chunk = _nodes_per_chunk(model, streams, job.collate_fn, device, cfg.microbatch_size or cfg.batch_size)
    val_batches = _validation_batches(job, 0, device)
    evaluator = node_replica(model) if val_batches else None

    def evaluate_global() -> dict[str, float]:
        if evaluator is None:
            return {}
        return _evaluate(evaluator, [t[0] for t in strategy.global_parameters()], val_batches)

    initial = evaluate_global()
    losses: list[list[float]] = [[] for _ in range(nodes)]
    seconds: list[float] = []
    history_val: dict[int, dict[str, float]] = {}
    progress = Progress(max_steps, enabled=cfg.progress, title=strategy.name)
    show_every = max(1, min(max_steps // 100, 25))
    watched = [observers.NodeReporter(r, max_steps, own_thread=False) for r in range(nodes)] \
        if observers.active() else []
    loop_started = time.perf_counter()
    with progress:
        for step in range(max_steps):
            comm.step = step
            indices = [batches.next_indices() for _, batches in streams]
            if sole_backward(cfg, len(list(split_microbatches(indices[0], cfg.microbatch_size)))):
                strategy.before_sole_backward(step)  # records what a launched run overlaps
            step_losses = _forward_backward(job, streams, indices, node_losses, randomness, holder, chunk)
            if randomness is not None and not randomness.drew:
                randomness, node_losses = None, _loss_function(model, 0, "error")
            values = _finite_losses(step_losses, holder, step)
            strategy.step(step)
            if cfg.check_sync:
                _check_rows(strategy, step)
            for r, v in enumerate(values):
                losses[r].append(v)
            seconds.append(time.time() - job.started)
            for r, reporter in enumerate(watched):
                reporter.step_done(step + 1, values[r], comm.logs[r].bytes_sent)
            last = step == max_steps - 1
            if cfg.val_interval and (step + 1) % cfg.val_interval == 0 and not last and val_batches:
                history_val[step] = evaluate_global()
                history_val[step]["node_val_loss"] = _node_val_loss(model, holder, val_batches)
            if (step == 0 or (step + 1) % show_every == 0) and not last:
                progress.update(step + 1, sum(values) / nodes, _mean_sent(comm, startup_sent))
        strategy.finish(max_steps - 1)
        if cfg.check_sync:
            _check_rows(strategy, max_steps - 1)
        for r, reporter in enumerate(watched):
            reporter.step_done(max_steps, losses[r][-1], comm.logs[r].bytes_sent, final=True)
        progress.update(max_steps, sum(v[-1] for v in losses) / nodes, _mean_sent(comm, startup_sent))
    loop_seconds = time.perf_counter() - loop_started

    _keep_global_model(strategy, names, own)
    final = evaluate_global() if evaluator is not None else {}
    reports = [NodeReport(losses[r], seconds, *_bytes_per_step(comm, r, max_steps), startup_sent[r])
               for r in range(nodes)]
    return _finish(job, strategy, model, comm, reports, history_val, initial, final, loop_seconds,
                   max_steps, progress)


def _finite_losses(step_losses: torch.Tensor, holder: _StackedParameters, step: int) -> list[float]:
    """Every node's loss of ``step``. A NaN or infinite loss or gradient stops the run before
    the strategy's step spreads it to other nodes, naming the first node it is on, as the
    threads runtime's guard does (:class:`NodeFailed` carrying a :class:`NonFiniteLoss`)."""
    values: list[float] = step_losses.tolist()
    bad_loss = next((r for r, v in enumerate(values) if not math.isfinite(v)), None)
    bad_grads = _non_finite_gradient_nodes(holder)
    if bad_loss is None and not bad_grads:
        return values
    node = min(r for r in (bad_loss, *bad_grads) if r is not None)
    problem = f"loss is {values[node]}" if node == bad_loss else "a gradient is not finite"
    error = NonFiniteLoss(f"{problem} at step {step + 1} on node {node}")
    try:
        raise error
    except NonFiniteLoss:
        raise NodeFailed(node, f"NonFiniteLoss: {error}", traceback.format_exc()) from error


def _non_finite_gradient_nodes(holder: _StackedParameters) -> list[int]:
    """The nodes whose gradient (their row of any stacked gradient) holds a NaN or infinity."""
    grads = [p.grad for p in holder.stacked if p.grad is not None and p.grad.numel()]
    if not grads:
        return []
    nodes = grads[0].shape[0]
    # A row's sum is finite when every value is (a NaN or infinity propagates): one reduction
    # per tensor. Large finite values may overflow a sum, so only then the exact check.
    suspects = torch.stack([~g.reshape(nodes, -1).sum(dim=1).isfinite() for g in grads]) \
        .any(dim=0).nonzero().flatten().tolist()
    return [r for r in suspects if not all(bool(g[r].isfinite().all()) for g in grads)]


def _finish(job: NodeJob, strategy: Strategy, model: nn.Module, comm: StackedCommunicator,
            reports: list[NodeReport], history_val: dict[int, dict[str, float]],
            initial: dict[str, float], final: dict[str, float], loop_seconds: float, max_steps: int,
            progress: Progress) -> FitResult:
    """The history, summary, projection and run directory, as the node loop's report writes them."""
    cfg = job.config
    history = history_rows(job, strategy, reports, history_val, final, max_steps)
    summary = run_summary(job, strategy, history, final, reports, model)
    summary["initial"] = initial
    summary["skipped_steps"] = 0
    summary["projected"] = _projection(job, comm, loop_seconds, max_steps)
    add_projected_seconds(history, comm.log.records, get_cluster(cfg.cluster),
                           summary["projected"]["step_seconds"])
    run_dir = write_run(job, strategy, model, history, summary, progress.lines)
    observers.notify("run_finished", summary, history)
    return FitResult(model=model, history=history, run_dir=run_dir, summary=summary)


def _keep_global_model(strategy: Strategy, names: list[str], own: dict[str, nn.Parameter]) -> None:
    """After the final sync every node holds the global model: the returned model gets it."""
    final_params = [t[0].clone() for t in strategy.params_data()]
    with torch.no_grad():
        for n, value in zip(names, final_params, strict=True):
            own[n].copy_(value)


def _node_streams(job: NodeJob) -> list[tuple[Any, NodeBatches]]:
    """Every node's dataset and batches, as the threads runtime gives them."""
    cfg, streams = job.config, []
    for rank in range(cfg.nodes):
        data, shard = resolve_dataset(job.train_data, rank, cfg.nodes, "train")
        streams.append((data, NodeBatches(data, rank=rank, nodes=cfg.nodes, batch_size=cfg.batch_size,
                                          seed=cfg.seed, shuffle=cfg.shuffle, shard=shard)))
    return streams


def _forward_backward(job: NodeJob, streams: list[tuple[Any, NodeBatches]], indices: list[list[int]],
                      node_losses: Callable[..., torch.Tensor], randomness: NodeRandomness | None,
                      holder: _StackedParameters, chunk: int) -> torch.Tensor:
    """Every node's forward and backward on its own batch (in microbatches, and ``chunk``
    nodes at a time, on the parameters' device); every node's loss."""
    nodes, device = len(streams), holder.stacked[0].device
    step_losses = torch.zeros(nodes, dtype=torch.float64)
    pieces = [list(split_microbatches(ix, job.config.microbatch_size)) for ix in indices]
    for micro in zip(*pieces, strict=True):
        batch = to_device(_node_batches(streams, micro, job.collate_fn), device)
        weight = len(micro[0]) / len(indices[0])
        for start in range(0, nodes, chunk):
            stop = min(nodes, start + chunk)
            if chunk == nodes:  # one computation: the gradients land in the stacked tensors
                params, rows = holder.by_name(), batch
            else:  # this chunk's rows as leaves of their own, their gradients copied in below
                params = {n: t.detach()[start:stop].requires_grad_(True) for n, t in holder.by_name().items()}
                rows = _rows(batch, start, stop)
            # bf16: the forward pass autocast, as the threads runtime's nodes run theirs
            with memory.autocast(job.config.precision, device):
                if randomness is not None:
                    randomness.active = randomness.generators[start:stop]
                    with randomness:
                        loss = node_losses(params, rows)
                else:
                    loss = node_losses(params, rows)
            # Node i's loss depends on row i only: the sum's gradient is every node's own.
            (loss.sum() * weight).backward()
            if chunk != nodes:
                _add_rows_grad(holder, params, start, stop)
            # To the CPU first: MPS has no float64.
            step_losses[start:stop] += loss.detach().cpu().double() * weight
    return step_losses


#: The vmap runtime on CPU computes the nodes in chunks whose largest activation stays under
#: this: glibc's malloc serves a block over 32 MiB from fresh pages every time (a page fault
#: per 4 KiB: 16 nodes of the gpt task took 300,000 faults and 1.6x the CPU per step).
CHUNK_ACTIVATION_BYTES = 16 * 2**20


def _nodes_per_chunk(model: nn.Module, streams: list[tuple[Any, NodeBatches]], collate_fn: Any,
                     device: torch.device, batch_size: int) -> int:
    """How many nodes one vectorised computation holds: all of them on a GPU; on CPU as many
    as keep the largest tensor saved for backward under :data:`CHUNK_ACTIVATION_BYTES`,
    measured on two nodes of one sample (a small model's nodes all fit one computation)."""
    nodes = len(streams)
    if device.type != "cpu":
        return nodes
    largest = 0
    params = {n: p.detach().unsqueeze(0).expand(2, *p.shape).clone().requires_grad_(True)
              for n, p in model.named_parameters() if p.requires_grad}
    weights = {t.untyped_storage().data_ptr()
               for t in [*params.values(), *model.parameters(), *model.buffers()]}

    def note(t: torch.Tensor) -> torch.Tensor:  # activations only: weights do not grow with the batch
        nonlocal largest
        if t.untyped_storage().data_ptr() not in weights:
            largest = max(largest, t.numel() * t.element_size())
        return t

    one = to_device(fetch(streams[0][0], [0], collate_fn), device)
    with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t), NodeRandomness([0, 1], device):
        _loss_function(model, 0)(params, _stack_batches([one, one]))
    per_node = largest / 2 * batch_size
    return max(1, min(nodes, int(CHUNK_ACTIVATION_BYTES // max(1.0, per_node))))


def _rows(batch: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` (nodes) of every tensor of a stacked batch."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, dict):
        return {k: _rows(v, start, stop) for k, v in batch.items()}
    return type(batch)(_rows(v, start, stop) for v in batch)


def _add_rows_grad(holder: _StackedParameters, chunk_params: dict[str, torch.Tensor], start: int,
                   stop: int) -> None:
    """Add a chunk's gradients into rows ``start:stop`` of the stacked gradients (a parameter
    no node used keeps ``grad = None``, as in one computation)."""
    for stacked, part in zip(holder.stacked, chunk_params.values(), strict=True):
        if part.grad is None:
            continue
        if stacked.grad is None:
            stacked.grad = torch.zeros_like(stacked)
        stacked.grad[start:stop] += part.grad


def _bound_strategy(job: NodeJob, holder: _StackedParameters, comm: StackedCommunicator,
                    max_steps: int, num_samples: int) -> Strategy:
    strategy = copy.deepcopy(job.strategy)
    strategy.stacked_nodes = comm.world_size
    strategy.setup(holder, comm, seed=job.config.seed, max_steps=max_steps, num_samples=num_samples)
    if strategy.optimizer is not None and not strategy.optim.chooses_implementation:
        # A few large stacked tensors: torch's fused kernel (one pass per tensor, CPU and
        # CUDA) steps them 3x faster than a loop of element-wise ops, per tensor or per list.
        # Same update rule, element by element; unless the optimizer's options chose an
        # implementation. Not for bf16 or fp16 parameters: there the fused kernels round
        # otherwise than torch's default ones (SGD: 12% of bf16 elements differ after one
        # step), and a bf16 model's losses drifted several percent from the threads runtime's.
        for group in strategy.optimizer.param_groups:
            if all(p.dtype in (torch.float32, torch.float64) for p in group["params"]):
                group["foreach"], group["fused"] = False, True
    return strategy


@torch.no_grad()
def _evaluate(evaluator: nn.Module, global_params: list[torch.Tensor],
              batches: list[Any]) -> dict[str, float]:
    """The global model's validation metrics, as the threads runtime's rank 0 computes them."""
    for p, g in zip([p for p in evaluator.parameters() if p.requires_grad], global_params, strict=True):
        p.copy_(g)
    out = {"val_loss": mean_loss(evaluator, batches)}
    hook = getattr(evaluator, "validation_metrics", None)
    if callable(hook):
        evaluator.eval()
        out.update({f"val_{k}": float(v) for k, v in hook(batches).items()})
        evaluator.train()
    return out


@torch.no_grad()
def _node_val_loss(model: nn.Module, holder: _StackedParameters, batches: list[Any]) -> float:
    """The mean over nodes of each node model's validation loss (eval mode)."""
    model.eval()
    try:
        losses = _loss_function(model, None)
        total = torch.zeros(holder.stacked[0].shape[0], dtype=torch.float64)
        count = 0
        for batch in batches:
            n = _batch_len(batch)
            total += losses(holder.by_name(), batch).cpu().double() * n  # MPS has no float64
            count += n
    finally:
        model.train()
    return float((total / max(1, count)).mean())


def _check_rows(strategy: Strategy, step: int) -> None:
    """``check_sync``: what the strategy promises identical is identical in every node's row."""
    promised = strategy.synced(step)
    if promised is None:
        return
    tensors, _ = promised
    differ = sorted({r for t in tensors for r in range(1, t.shape[0]) if not torch.equal(t[r], t[0])})
    if differ:
        raise ReplicaDrift(f"after step {step + 1}, node(s) {', '.join(map(str, differ))} hold "
                           f"parameters that differ from node 0's, although {strategy.name} "
                           "keeps them identical")


def _mean_sent(comm: StackedCommunicator, startup_sent: list[int]) -> float:
    return sum(log.bytes_sent - s for log, s in zip(comm.logs, startup_sent, strict=True)) / len(comm.logs)


def _bytes_per_step(comm: StackedCommunicator, rank: int, steps: int) -> tuple[list[int], list[int]]:
    sent, received = [0] * steps, [0] * steps
    for r in comm.logs[rank].records:
        if 0 <= r.step < steps:
            sent[r.step] += r.bytes_sent
            received[r.step] += r.bytes_received
    return sent, received


def _projection(job: NodeJob, comm: StackedCommunicator, loop_seconds: float, steps: int) -> dict[str, Any]:
    """Node 0's collectives and compute replayed on the configured cluster; one node's
    compute per step is the loop's time over the nodes (they share one computation on
    ``threads`` cores)."""
    cfg = job.config
    step_seconds = cfg.step_seconds
    if step_seconds is None:
        busy = max(0.0, loop_seconds - comm.log.seconds)
        step_seconds = busy * (cfg.threads or 1) / cfg.nodes / max(1, steps)
    out: dict[str, Any] = dict(project(comm.log.records, get_cluster(cfg.cluster), steps, step_seconds))
    return {**out, "step_seconds": step_seconds}
