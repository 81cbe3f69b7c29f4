"""What every node of a run does: the training loop, and rank 0's report of the run.

:func:`train_node` is the loop each node runs, whatever runtime hosts it; at the end
rank 0 gathers the nodes' reports and writes the run directory (history, summary,
projection onto a cluster, provenance).
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, astuple, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshtrain import checkpoint, observers
from meshtrain.cluster import (
    Cluster,
    collective_seconds,
    get_cluster,
    measured_step_seconds,
    project,
    sync_waits,
)
from meshtrain.comm import Communicator
from meshtrain.comm.communicator import CommLog, CommRecord
from meshtrain.data import (
    NodeBatches,
    fetch,
    resolve_dataset,
    split_microbatches,
    to_device,
)
from meshtrain.devices import resolve_device
from meshtrain.engine import loggers
from meshtrain.engine.job import FitResult, NodeJob
from meshtrain.errors import RunFailure
from meshtrain.faults import FaultPlan, check_steps
from meshtrain.heartbeat import status_reporter
from meshtrain.progress import Progress
from meshtrain.run_dir import RunDirectory
from meshtrain.seeding import mix_seed
from meshtrain.strategies import Strategy
from meshtrain.version import __version__


@dataclass
class NodeReport:
    """What a node sends rank 0 at the end: its per-step numbers."""

    losses: list[float]
    seconds: list[float]  # since the run started, at the end of each step
    bytes_sent: list[int]
    bytes_received: list[int]
    startup_bytes_sent: int


def node_seed(seed: int, rank: int) -> int:
    """Seed of a node's own randomness (dropout): different per node, reproducible."""
    return mix_seed(seed, rank, 0xD20)


def node_replica(model: nn.Module) -> nn.Module:
    """A node's own copy of ``model`` that shares its frozen parameters.

    Frozen weights never change, so the nodes of one process (and rank 0's evaluator)
    hold one copy of them: under LoRA that is nearly the whole model. Everything that
    trains, and every buffer, is the node's own.
    """
    frozen = {id(p): p for p in model.parameters() if not p.requires_grad}
    return copy.deepcopy(model, memo=dict(frozen))


def train_node(
    job: NodeJob,
    comm: Communicator,
    *,
    rng_guard: Callable[[], Any] | None = None,
    verify_replicas: bool = False,
) -> FitResult:
    """The training loop every node runs. Returns the global model on every node;
    history, summary and the run directory on rank 0 only.

    ``rng_guard`` (threads runtime) is a context manager giving this node exclusive use
    of torch's global generator, holding the node's own stream, around forward passes.
    """
    cfg, rank = job.config, comm.rank
    device = resolve_device(cfg.device)
    model = node_replica(job.model).to(device)
    model.train()
    train_set, shard = resolve_dataset(job.train_data, rank, cfg.nodes, "train")
    batches = NodeBatches(train_set, rank=rank, nodes=cfg.nodes, batch_size=cfg.batch_size,
                          seed=cfg.seed, shuffle=cfg.shuffle, shard=shard)
    comm.step = -1  # start-up traffic
    max_steps = cfg.steps or _agreed_epoch_steps(cfg.epochs, len(batches), comm)  # type: ignore[arg-type]
    plan = cfg.fault_plan()
    check_steps(plan, max_steps)  # with epochs, the step count is known only now
    departed: dict[int, NodeReport] = {}  # rank 0: reports of nodes that left (--fail)
    strategy = copy.deepcopy(job.strategy)
    if verify_replicas:
        _verify_replicas(model, comm)
    strategy.setup(model, comm, seed=cfg.seed, max_steps=max_steps,
                   num_samples=len(batches.indices))
    startup_sent = comm.log.bytes_sent

    val_batches = _validation_batches(job, rank, device)
    evaluator = _GlobalEvaluator(model, val_batches) if rank == 0 and val_batches else None
    history_val: dict[int, dict[str, float]] = {}
    losses: list[float] = []
    seconds: list[float] = []
    skipped: list[int] = []  # steps skipped everywhere for a non-finite loss (skip_nonfinite)
    first_step, seconds_before, loop_before = 0, 0.0, 0.0
    if job.resume is not None:
        saved = checkpoint.load_node(job.resume, rank)
        model.load_state_dict(saved["model"])
        strategy.load_state_dict(saved["strategy"])
        shrunk = job.resume.nodes != cfg.nodes
        # On fewer nodes the shards are cut anew, so a saved position means nothing there:
        # the new shards start a fresh epoch (the lost node's samples are in them).
        batches.load_state_dict({"epoch": saved["data"]["epoch"] + 1, "position": 0} if shrunk
                                else saved["data"])
        _set_node_rng_state(saved["rng"], rng_guard)
        comm.log = CommLog([CommRecord(*r) for r in saved["comm"]], *saved["comm_totals"])
        losses, seconds, history_val = list(saved["losses"]), list(saved["seconds"]), saved["val"]
        skipped = list(saved["skipped"])
        initial, startup_sent = saved["initial"], saved["startup_sent"]
        first_step, loop_before = saved["step"], saved["loop_seconds"]
        seconds_before = seconds[-1] if seconds else 0.0
        if shrunk:  # the global state came from each survivor's own file: prove it is one state
            _check_sync(strategy, comm, first_step - 1)
    else:
        # Step 0: the global model before training, so every run shows before and after.
        initial = evaluator.evaluate(strategy.params_data()) if evaluator else {}
    progress = Progress(max_steps, enabled=cfg.progress and rank == 0, title=strategy.name)
    # Loggers (rank 0) get the progress bar's numbers on its schedule, so they need them too.
    live = loggers.RunLoggers.for_run(job, strategy, initial) if rank == 0 else loggers.RunLoggers()
    shown = _ProgressNumbers(comm, startup_sent, max_steps,
                             lines_only=cfg.runtime == "launched" and not loggers.wanted(cfg)) \
        if cfg.progress or loggers.wanted(cfg) else None

    def save_checkpoint(steps_done: int) -> None:
        """Every node saves its state; rank 0 publishes the checkpoint once all have."""
        assert job.checkpoints is not None
        state = {
            "run_id": job.run_id, "step": steps_done, "rank": rank,
            "model": model.state_dict(), "strategy": strategy.state_dict(),
            "data": batches.state_dict(), "rng": _node_rng_state(rng_guard),
            "comm": [astuple(r) for r in comm.log.records],
            "comm_totals": [comm.log.bytes_sent, comm.log.bytes_received, comm.log.seconds],
            "losses": losses, "seconds": seconds, "val": history_val, "initial": initial,
            "skipped": skipped,
            "startup_sent": startup_sent,
            "loop_seconds": loop_before + time.perf_counter() - loop_started,
        }
        digest = checkpoint.save_node(job.checkpoints, steps_done, rank, state)
        hashes = comm.gather_json({"rank": rank, "sha256": digest})  # also: every node has saved
        if cfg.runtime == "launched":  # every host keeps its own rank's checkpoint
            checkpoint.commit(job.checkpoints, steps_done, job.run_id, {rank: digest},
                              cfg.keep_checkpoints, cfg.nodes)
        elif hashes is not None:
            checkpoint.commit(job.checkpoints, steps_done, job.run_id,
                              {h["rank"]: h["sha256"] for h in hashes}, cfg.keep_checkpoints, cfg.nodes)

    # A rank of `meshtrain launch` tells the launcher's live view where it is (heartbeat.py).
    status = status_reporter(max_steps, first_step) if cfg.runtime == "launched" else None
    # Observers in this process (the live dashboard of `simulate --dashboard`) see every node.
    watched = observers.NodeReporter(rank, max_steps, own_thread=cfg.runtime == "threads") \
        if observers.active() else None
    loop_started = time.perf_counter()
    with progress, live.closed_on_failure():
        for step in range(first_step, max_steps):
            comm.check_abort()  # another node failed or the run was interrupted: stop here
            comm.step = step
            if plan.failures and plan.alive_at(step, cfg.nodes) != comm.alive:
                if watched is not None and rank not in plan.alive_at(step, cfg.nodes):  # its last word
                    watched.step_done(step, losses[-1] if losses else None, comm.log.bytes_sent, final=True)
                if not _leave_or_go_on(comm, plan, step, departed, progress, max_steps,
                                       NodeReport(losses, seconds, *_bytes_per_step(comm, max_steps),
                                                  startup_sent)):
                    return FitResult(model=model, history=[], run_dir=None, summary={})
            indices = batches.next_indices()
            loss_value = 0.0
            for micro in split_microbatches(indices, cfg.microbatch_size):
                batch = to_device(fetch(train_set, micro, job.collate_fn), device)
                weight = len(micro) / len(indices)
                if rng_guard is not None:
                    with rng_guard():
                        loss = model(batch)
                else:
                    loss = model(batch)
                (loss * weight).backward()
                loss_value += loss.item() * weight
            problem = _non_finite(loss_value, strategy.params)
            if cfg.skip_nonfinite:  # every node must agree to skip: one flag, max over nodes
                flag = torch.tensor([0.0 if problem is None else 1.0], dtype=torch.float64)
                comm.all_reduce(flag, op="max", record=False)
                skip = bool(flag.item())
            elif problem is not None:
                raise NonFiniteLoss(f"{problem} at step {step + 1} on node {rank}")
            else:
                skip = False
            if skip:
                strategy.skip_step(step)
                skipped.append(step + 1)
                if rank == 0:
                    observers.notify("event", "nonfinite", f"step {step + 1} skipped: a node's loss or "
                                     "parameters were not finite (--skip-nonfinite)")
            else:
                strategy.step(step)
            if cfg.check_sync:
                _check_sync(strategy, comm, step)
            losses.append(loss_value)
            seconds.append(seconds_before + time.time() - job.started)
            if status is not None:
                status.step_done(step + 1, loss_value, comm.log.bytes_sent, strategy)
            if watched is not None:
                watched.step_done(step + 1, loss_value, comm.log.bytes_sent)
            last = step == max_steps - 1
            if cfg.val_interval and (step + 1) % cfg.val_interval == 0 and not last and val_batches:
                history_val[step] = _validate(strategy, model, comm, evaluator, val_batches)
                live.log(history_val[step], step + 1)
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and not last:
                save_checkpoint(step + 1)
            if shown is not None and shown.due(step):
                mean_loss_now, sent_now = shown.collect(loss_value)
                progress.update(step + 1, mean_loss_now, sent_now)
                live.log({"train_loss": mean_loss_now, "total_bytes_sent": sent_now}, step + 1)
        strategy.finish(max_steps - 1)
        if status is not None:  # with the final sync's bytes
            status.step_done(max_steps, losses[-1] if losses else None, comm.log.bytes_sent, strategy,
                             final=True)
        if watched is not None:
            watched.step_done(max_steps, losses[-1] if losses else None, comm.log.bytes_sent, final=True)
        if cfg.check_sync:
            _check_sync(strategy, comm, max_steps - 1)
        if shown is not None:  # the final sync's bytes count too
            progress.update(max_steps, *shown.collect(losses[-1]))
    loop_seconds = loop_before + time.perf_counter() - loop_started
    # After finish every node holds the global model: node val loss equals the global one.
    final = evaluator.evaluate(strategy.params_data()) if evaluator else {}

    report = NodeReport(losses, seconds, *_bytes_per_step(comm, max_steps), startup_sent)
    gathered = comm.gather_json(asdict(report))
    if rank != 0:
        return FitResult(model=model, history=[], run_dir=None, summary={})
    assert gathered is not None
    by_rank = {**departed, **{r: NodeReport(**g) for r, g in zip(comm.alive, gathered, strict=True)}}
    reports = [by_rank[r] for r in range(cfg.nodes)]
    history = _history(job, strategy, reports, history_val, final, max_steps, plan)
    summary = _summary(job, strategy, history, final, reports, model)
    if plan:
        summary["faults"] = plan.to_dict()
    summary["initial"] = initial
    summary["skipped_steps"] = len(skipped)
    if cfg.skip_nonfinite:
        skipped_steps = set(skipped)
        for row in history:
            row["skipped"] = int(row["step"] in skipped_steps)
    summary["projected"] = _projection(job, comm, loop_seconds, max_steps, plan)
    _add_projected_seconds(history, comm.log.records, get_cluster(cfg.cluster),
                           summary["projected"]["step_seconds"],
                           [plan.slowdown_at(s, cfg.nodes) for s in range(max_steps)])
    with live.closed_on_failure():  # before the run directory is committed (TensorBoard's files)
        live.finish(history[-1], summary)
    run_dir = _write_run(job, strategy, model, history, summary, progress.lines)
    observers.notify("run_finished", summary, history)
    return FitResult(model=model, history=history, run_dir=run_dir, summary=summary)


def _leave_or_go_on(comm: Communicator, plan: FaultPlan, step: int, departed: dict[int, NodeReport],
                    progress: Progress, steps: int, report: NodeReport) -> bool:
    """At the start of 0-based ``step``, the nodes the plan removes leave (``--fail``).

    Every node of the old membership meets once more: each leaving node hands rank 0 its
    report (unrecorded: a real failure would lose it, but the simulation keeps the losses
    and bytes of the steps it took). Then the survivors go on among themselves. Returns
    False on a node that leaves here.
    """
    now = plan.alive_at(step, comm.world_size)
    leaving = comm.rank not in now
    gathered = comm.gather_json(asdict(report) if leaving else None)
    if gathered is not None:  # rank 0
        gone = [r for r in comm.alive if r not in now]
        for r, value in zip(comm.alive, gathered, strict=True):
            if r in gone:
                departed[r] = NodeReport(**value)
        names = ", ".join(map(str, gone))
        progress.note(f"step {step}/{steps}  node{'s' if len(gone) > 1 else ''} {names} left "
                      f"(--fail); {len(now)} node{'s' if len(now) > 1 else ''} go on")
        for r in gone:
            observers.notify("node_ended", r, "lost", f"left at step {step} (--fail)")
        observers.notify("event", "left", f"step {step}: node{'s' if len(gone) > 1 else ''} {names} left "
                         f"(--fail); {len(now)} go on")
    comm.set_alive(now)
    return not leaving


def _non_finite(loss: float, params: Sequence[torch.Tensor]) -> str | None:
    """What is NaN or infinite this step (the loss, else a gradient), or None."""
    if not math.isfinite(loss):
        return f"loss is {loss}"
    grads = [p.grad for p in params if p.grad is not None]
    # One fused pass: the largest |value| of each gradient is NaN or inf exactly when the
    # gradient holds one (a max never overflows, unlike a sum).
    if grads and not bool(torch.stack(torch._foreach_norm(grads, float("inf"))).isfinite().all()):
        return "a gradient is not finite"
    return None


def _node_rng_state(rng_guard: Callable[[], Any] | None) -> torch.Tensor:
    """This node's random stream (in the threads runtime it lives behind the guard)."""
    if rng_guard is None:
        return torch.get_rng_state()
    with rng_guard():
        return torch.get_rng_state()


def _set_node_rng_state(state: torch.Tensor, rng_guard: Callable[[], Any] | None) -> None:
    if rng_guard is None:
        torch.set_rng_state(state)
        return
    with rng_guard():
        torch.set_rng_state(state)


class ReplicaDrift(RunFailure):
    """Nodes that a strategy keeps identical were found to differ (``check_sync``)."""


def _check_sync(strategy: Strategy, comm: Communicator, step: int) -> None:
    """Compare, by SHA-256, what the strategy promises is identical after ``step``."""
    promised = strategy.synced(step)
    if promised is None:
        return
    tensors, group = promised
    members = comm.members(group)
    digests = comm.all_gather(_digest(tensors), group=group, record=False)
    differ = [m for m, d in zip(members, digests, strict=True) if not torch.equal(d, digests[0])]
    if differ:
        raise ReplicaDrift(f"after step {step + 1}, node(s) {', '.join(map(str, differ))} hold "
                           f"parameters that differ from node {members[0]}'s, although "
                           f"{strategy.name} keeps them identical")


class NonFiniteLoss(RunFailure):
    """A node's loss became NaN or infinite: the run stops, naming the step and node."""


class _ProgressNumbers:
    """What the progress bar shows, defined as in the results: the loss is the mean over
    nodes, bytes are sent per node (mean) since the first step. Collected by a small
    unrecorded all-reduce after the first step, then every 1% of the run but at least every
    25 steps (a long run still shows progress at once), on a schedule every node knows.

    With ``lines_only`` (a launched run without loggers: its ranks print plain lines, about
    ten per run, never a redrawn bar) they are collected only for those lines, so a
    launched step pays no extra round trip over the real link."""

    def __init__(self, comm: Communicator, startup_sent: int, steps: int, *,
                 lines_only: bool = False) -> None:
        self.comm = comm
        self.startup_sent = startup_sent
        self.lines_only = lines_only
        # Progress prints a line at step 1, then every steps // 10 steps: the same steps.
        self.every = max(1, steps // 10) if lines_only else max(1, min(steps // 100, 25))
        self.steps = steps

    def due(self, step: int) -> bool:
        if self.lines_only:
            return step % self.every == 0 and step + 1 < self.steps
        return (step == 0 or (step + 1) % self.every == 0) and step + 1 < self.steps

    def collect(self, loss: float) -> tuple[float, float]:
        numbers = torch.tensor([loss, self.comm.log.bytes_sent - self.startup_sent], dtype=torch.float64)
        self.comm.all_reduce(numbers, op="mean", record=False)
        return float(numbers[0]), float(numbers[1])


def _agreed_epoch_steps(epochs: float, batches_per_epoch: int, comm: Communicator) -> int:
    """Steps for ``epochs`` of the smallest node's data: every node must take the same number
    of steps (factory datasets may differ in size), so they agree on the minimum."""
    mine = max(1, math.ceil(epochs * batches_per_epoch))
    steps = torch.tensor([-mine], dtype=torch.float64)
    comm.all_reduce(steps, op="max", record=False)
    return int(-steps.item())


def _verify_replicas(model: nn.Module, comm: Communicator) -> None:
    """Frozen weights must already match on every node (checked by hash, never sent);
    trainable ones that differ are replaced by rank 0's (one broadcast)."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    trainable = [p for p in model.parameters() if p.requires_grad]
    digests = torch.stack([_digest(frozen), _digest(trainable)])
    everyone = comm.all_gather(digests, record=False)
    for rank, theirs in enumerate(everyone):
        if not torch.equal(theirs[0], everyone[0][0]):
            raise RuntimeError(
                f"frozen weights on node {rank} differ from node 0: load the same base "
                "checkpoint on every host"
            )
    if any(not torch.equal(theirs[1], everyone[0][1]) for theirs in everyone):
        comm.broadcast([p.data for p in trainable], src=0)


def _digest(params: Sequence[torch.Tensor]) -> torch.Tensor:
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8)


def _validation_batches(job: NodeJob, rank: int, device: torch.device) -> list[Any]:
    if job.val_data is None:
        return []
    cfg = job.config
    val_set, _ = resolve_dataset(job.val_data, rank, cfg.nodes, "val")
    n = len(val_set)  # type: ignore[arg-type]
    if cfg.val_size is not None:
        n = min(n, cfg.val_size)
    return [
        to_device(fetch(val_set, list(range(s, min(n, s + cfg.batch_size))), job.collate_fn), device)
        for s in range(0, n, cfg.batch_size)
    ]


@torch.no_grad()
def mean_loss(model: nn.Module, batches: list[Any]) -> float:
    """Mean loss of ``model`` over ``batches`` (weighted by batch length), in eval mode."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        n = _batch_len(batch)
        total += float(model(batch)) * n
        count += n
    model.train(was_training)
    return total / max(1, count)


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return len(batch)
    if isinstance(batch, (tuple, list)) and batch:
        return _batch_len(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_len(next(iter(batch.values())))
    return 1


class _GlobalEvaluator:
    """Rank 0's scratch copy of the model, loaded with global parameters to evaluate."""

    def __init__(self, model: nn.Module, batches: list[Any]) -> None:
        self.model = node_replica(model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.batches = batches

    @torch.no_grad()
    def evaluate(self, global_params: list[torch.Tensor]) -> dict[str, float]:
        for p, g in zip(self.params, global_params, strict=True):
            p.copy_(g)
        out = {"val_loss": mean_loss(self.model, self.batches)}
        hook = getattr(self.model, "validation_metrics", None)
        if callable(hook):
            self.model.eval()
            out.update({f"val_{k}": float(v) for k, v in hook(self.batches).items()})
            self.model.train()
        return out


def _validate(
    strategy: Strategy,
    model: nn.Module,
    comm: Communicator,
    evaluator: _GlobalEvaluator | None,
    val_batches: list[Any],
) -> dict[str, float]:
    """Global-model metrics (rank 0) and the mean of the node models' val losses."""
    global_params = strategy.global_parameters()
    node_loss = torch.tensor([mean_loss(model, val_batches)], dtype=torch.float64)
    comm.all_reduce(node_loss, op="mean", record=False)
    out = evaluator.evaluate(global_params) if evaluator else {}
    out["node_val_loss"] = float(node_loss)
    return out


def _bytes_per_step(comm: Communicator, steps: int) -> tuple[list[int], list[int]]:
    sent, received = [0] * steps, [0] * steps
    for r in comm.log.records:
        if 0 <= r.step < steps:
            sent[r.step] += r.bytes_sent
            received[r.step] += r.bytes_received
    return sent, received


def _history(
    job: NodeJob,
    strategy: Strategy,
    reports: list[NodeReport],
    val: dict[int, dict[str, float]],
    final: dict[str, float],
    steps: int,
    plan: FaultPlan | None = None,
) -> list[dict[str, Any]]:
    """Per-step records: losses averaged over the step's nodes (alive ones, with ``--fail``),
    bytes as their per-node mean; ``reports`` holds every node's, by rank."""
    plan = plan or FaultPlan()
    history: list[dict[str, Any]] = []
    total_sent = total_received = 0.0
    examples = 0
    for step in range(steps):
        alive = [reports[r] for r in plan.alive_at(step, len(reports))]
        n = len(alive)
        sent = sum(r.bytes_sent[step] for r in alive) / n
        received = sum(r.bytes_received[step] for r in alive) / n
        total_sent += sent
        total_received += received
        examples += job.config.batch_size * n
        row: dict[str, Any] = {
            "step": step + 1,
            "nodes": n,
            "train_loss": sum(r.losses[step] for r in alive) / n,
            "val_loss": None,
            "node_val_loss": None,
            "lr": strategy.lr_at(step),
            "bytes_sent": sent,
            "bytes_received": received,
            "total_bytes_sent": total_sent,
            "total_bytes_received": total_received,
            "examples": examples,
            "seconds": reports[0].seconds[step],
        }
        row.update(val.get(step, {}))
        history.append(row)
    if final:
        history[-1].update(final)
        history[-1]["node_val_loss"] = final["val_loss"]
    return history


def _summary(
    job: NodeJob,
    strategy: Strategy,
    history: list[dict[str, Any]],
    final: dict[str, float],
    reports: list[NodeReport],
    model: nn.Module,
) -> dict[str, Any]:
    cfg = job.config
    last = history[-1]
    summary: dict[str, Any] = {
        "run_id": job.run_id,
        "strategy": strategy.name,
        "nodes": cfg.nodes,
        "runtime": cfg.runtime,
        "steps": len(history),
        "final_train_loss": last["train_loss"],
        "final_val_loss": final.get("val_loss"),
        "bytes_sent_per_node": last["total_bytes_sent"],
        "bytes_received_per_node": last["total_bytes_received"],
        "startup_bytes_sent_per_node": sum(r.startup_bytes_sent for r in reports) / len(reports),
        "examples": last["examples"],
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "parameters": sum(p.numel() for p in model.parameters()),
        "wall_seconds": time.time() - job.started,
    }
    for k, v in final.items():
        if k.startswith("val_") and k != "val_loss":
            summary[f"final_{k[4:]}"] = v
    return summary


def _projection(job: NodeJob, comm: Communicator, loop_seconds: float, steps: int,
                plan: FaultPlan | None = None) -> dict[str, Any]:
    """Rank 0's collectives and compute, replayed on the configured cluster.

    With stragglers a step's compute is its slowest alive node's (``step_seconds`` times
    the largest slowdown), and ``idle_seconds`` adds up, over steps and nodes, how long the
    faster nodes wait for it.
    """
    cfg = job.config
    plan = plan or FaultPlan()
    step_seconds = cfg.step_seconds
    if step_seconds is None:
        step_seconds = measured_step_seconds(loop_seconds, comm.log.seconds, steps, cfg.nodes,
                                             own_host=cfg.runtime == "launched")
        if plan.failures:  # fewer nodes shared this machine's cores after a node left
            node_steps = sum(len(plan.alive_at(s, cfg.nodes)) for s in range(steps))
            step_seconds *= steps * cfg.nodes / node_steps
    cluster = get_cluster(cfg.cluster)
    out: dict[str, Any] = dict(project(comm.log.records, cluster, steps, step_seconds))
    if plan.stragglers:
        slowest = sum(plan.slowdown_at(s, cfg.nodes) for s in range(steps))
        out["compute_seconds"] = slowest * step_seconds / cluster.speed
        out["total_seconds"] = (out["compute_seconds"] + out["communication_seconds"]
                                + out.get("sync_wait_seconds", 0.0))
        idle = sum(plan.idle_factor_at(s, cfg.nodes) for s in range(steps))
        out["idle_seconds"] = idle * step_seconds / cluster.speed
    # What this node spent inside its recorded collectives (waiting for peers included):
    # beside the projected communication, it shows where the model is off.
    return {**out, "step_seconds": step_seconds, "measured_communication_seconds": comm.log.seconds}


def _add_projected_seconds(history: list[dict[str, Any]], records: list[CommRecord], cluster: Cluster,
                           step_seconds: float, slowdowns: list[float] | None = None) -> None:
    """metrics.csv's ``projected_seconds``: the summary's projection, cumulative step by step
    (rank 0's collectives of each step plus its compute, times the step's straggler
    ``slowdowns``); the last row equals its total."""
    comm_seconds = [0.0] * len(history)
    for r in records:
        if r.step >= 0:  # a collective after the last step (the final sync) counts in the last step
            comm_seconds[min(r.step, len(history) - 1)] += collective_seconds(r, cluster)
    for step, wait in sync_waits(records, cluster).items():  # 0 unless the cluster has a jitter
        comm_seconds[min(step, len(history) - 1)] += wait
    total = 0.0
    slowdowns = slowdowns or [1.0] * len(history)
    for row, seconds, slowdown in zip(history, comm_seconds, slowdowns, strict=True):
        total += step_seconds * slowdown / cluster.speed + seconds
        row["projected_seconds"] = total


def _write_run(
    job: NodeJob,
    strategy: Strategy,
    model: nn.Module,
    history: list[dict[str, Any]],
    summary: dict[str, Any],
    log_lines: list[str],
) -> Path:
    cfg = job.config
    run = job.run_dir or RunDirectory.reserve(Path(cfg.out_dir), job.run_id, strategy.name, cfg.nodes)
    try:
        train = {k: v for k, v in asdict(cfg).items() if k not in ("extra_config", "progress")}
        run.write_config({**cfg.extra_config, "strategy": strategy.config(), "train": train,
                          "model": type(model).__name__, "provenance": provenance()})
        run.write_metrics(history, summary.get("initial") or {})
        run.write_log([f"$ {provenance()['command']}", *log_lines])
        run.write_model(model)
        run.write_plot(history, f"{strategy.name}, {cfg.nodes} nodes", summary.get("initial") or {})
        summary["wall_seconds"] = time.time() - job.started
        run.write_summary(summary)
        if job.checkpoints is not None and job.checkpoints.is_dir():
            os.replace(job.checkpoints, run.partial / "checkpoints")  # the finished run keeps them
        return run.commit()
    except OSError as exc:
        if run.partial.is_dir() and any(run.partial.iterdir()):
            kept = run.keep_incomplete()
            raise OSError(exc.errno, f"writing the run directory failed ({exc.strerror or exc}); "
                                     f"what was written is kept in {kept}") from exc
        run.discard()
        raise
    except BaseException:
        run.discard()
        raise


def provenance() -> dict[str, Any]:
    """Where a run came from: versions, the command line, and the git commit of the cwd."""
    commit = None
    try:
        found = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if found.returncode == 0:
            commit = found.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {"meshtrain": __version__, "torch": str(torch.__version__), "python": platform.python_version(),
            "command": " ".join(sys.argv), "git_commit": commit}
