"""What every node of a run does: the training loop.

:func:`train_node` is the loop each node runs, whatever runtime hosts it: read a batch,
forward and backward, let the strategy update (and communicate), repeat. Everything
else a step may do is a callback (:mod:`meshtrain.engine.callbacks`): faults, sync
checks, validation, checkpoints, progress and loggers, status. At the end rank 0
gathers the nodes' reports and writes the run (:mod:`meshtrain.engine.report`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from meshtrain import checkpoint
from meshtrain.comm import Communicator
from meshtrain.comm.communicator import CommLog, CommRecord
from meshtrain.comm.elastic import ElasticCommunicator
from meshtrain.config.settings import TrainConfig
from meshtrain.data import NodeBatches, SharedBatches, fetch, resolve_dataset, split_microbatches, to_device
from meshtrain.devices import resolve_device
from meshtrain.engine import balance, loggers, memory
from meshtrain.engine.callbacks import (
    Balancing,
    Callback,
    Checkpointing,
    ComputeClock,
    Faults,
    NodeRun,
    NonFiniteGuard,
    ProgressReport,
    RngGuard,
    StatusReport,
    SyncCheck,
    Validation,
    check_sync,
    digest,
    node_replica,
    set_node_rng_state,
)
from meshtrain.engine.elastic import ElasticNode, admits, placeholder_report
from meshtrain.engine.job import FitResult, NodeJob
from meshtrain.engine.report import NodeReport, finish_run
from meshtrain.errors import SettingError
from meshtrain.faults import check_steps
from meshtrain.progress import Progress, Status
from meshtrain.seeding import mix_seed

__all__ = ["node_replica", "node_seed", "sole_backward", "train_node"]


#: A launched rank's replica check is announced once it has taken this long (hashing
#: a large model's weights); a small model's passes without a line.
HASH_NOTICE_AFTER_S = 1.0


def node_seed(seed: int, rank: int) -> int:
    """Seed of a node's own randomness (dropout): different per node, reproducible."""
    return mix_seed(seed, rank, 0xD20)


def train_node(job: NodeJob, comm: Communicator, *, rng_guard: RngGuard | None = None,
               verify_replicas: bool = False, join_timeout: float | None = None) -> FitResult:
    """The training loop every node runs. Returns the global model on every node;
    history, summary and the run directory on rank 0 only.

    ``rng_guard`` (threads runtime) is a context manager giving this node exclusive use
    of torch's global generator, holding the node's own stream, around forward passes.
    ``join_timeout`` (an elastic run's node started again): wait this long to be admitted,
    then go on from a healthy peer's state (:mod:`meshtrain.engine.elastic`).
    """
    run = _start_node(job, comm, rng_guard, verify_replicas and join_timeout is None)
    validation = Validation(job, run.model, comm.rank, run.device, comm.check_abort)
    elastic = _begin(run, validation, join_timeout)
    callbacks = _callbacks(run, validation)
    guard = NonFiniteGuard()
    # Snapshots exist only in an elastic run (a fixed group never asks for one).
    snapshot = elastic.snapshot if elastic is not None else dict
    restore = elastic.restore if elastic is not None else (lambda saved: None)
    run.loop_started, run.collectives_before = time.perf_counter(), comm.log.seconds
    with run.progress, run.live.closed_on_failure():
        for step in range(run.first_step, run.max_steps):
            comm.check_abort()  # another node failed or the run was interrupted: stop here
            comm.step = step
            if not all([c.step_start(run, step) for c in callbacks]):  # this node leaves (--fail)
                return FitResult(model=run.model, history=[], run_dir=None, summary={})
            if elastic is not None:
                elastic.before_step()
            update = _compute_step(run, step, guard, overlap=elastic is None)
            # The update and everything after it that talks to the peers: an elastic run
            # undoes and redoes it without a peer lost in it (comm/elastic.py).
            admit = elastic is not None and admits(run.strategy, step, run.max_steps)
            # Every sync meets, the last one included: a node that sent nothing (alone in
            # its island) must still hear how its peers' sync went.
            comm.transaction(functools.partial(_end_step, run, step, update, callbacks), snapshot=snapshot,
                             restore=restore, admit=admit, step=step,
                             meet=elastic is not None and run.strategy.admits_joiners_after(step))
            if elastic is not None:
                elastic.after_step(step, admit)
        comm.transaction(functools.partial(_end_training, run, callbacks), snapshot=snapshot,
                         restore=restore, admit=False, step=run.max_steps - 1)
    # After finish every node holds the global model: node val loss equals the global one.
    final = validation.evaluate_global(run.strategy)
    return _report(run, final, elastic)


def _begin(run: NodeRun, validation: Validation, join_timeout: float | None) -> ElasticNode | None:
    """Where the node starts from: a healthy peer's state (an elastic run's joiner), a
    checkpoint, or step 0 (evaluated first, so every run shows before and after). Returns
    the node's elastic side in an elastic run."""
    comm = run.comm
    elastic = ElasticNode(run) if isinstance(comm, ElasticCommunicator) else None
    if isinstance(comm, ElasticCommunicator) and elastic is not None:
        comm.healer = elastic
        if join_timeout is not None:
            comm.join(join_timeout)
            return elastic
    if run.job.resume is not None:
        _resume(run)
    else:
        run.initial = validation.evaluate_untrained(run.strategy, shown=run.job.config.progress)
    return elastic


def _compute_step(run: NodeRun, step: int, guard: NonFiniteGuard, *, overlap: bool) -> Callable[[], object]:
    """A step's work before its update (its loss recorded); the update to run next."""
    strategy = run.strategy
    if strategy.trains_at(step):
        loss, update = _train_step(run, step, guard, overlap=overlap)
        run.losses.append(loss)
        return update
    # async-diloco: a slower node's step spans several loop steps
    guard.skips(run, step, 0.0)  # it still votes where the nodes agree on skipping
    # Shown where a loss is shown (progress, live view): its last one; the history leaves
    # the step out of its mean (idle_steps).
    run.losses.append(run.losses[-1] if run.losses else math.nan)
    run.idle_steps.append(step)
    return functools.partial(strategy.idle_step, step)


def _end_step(run: NodeRun, step: int, update: Callable[[], object], callbacks: list[Callback]) -> None:
    """The strategy's update (and this step's communication), then the callbacks."""
    update()
    if step == run.first_step:
        run.clock.first_step_done()
    run.seconds.append(run.seconds_before + time.time() - run.job.started)
    for c in callbacks:
        c.step_end(run, step)


def _end_training(run: NodeRun, callbacks: list[Callback]) -> None:
    """The strategy's final sync, then the callbacks' last word."""
    run.strategy.finish(run.max_steps - 1)
    for c in callbacks:
        c.train_end(run)


def _train_step(run: NodeRun, step: int, guard: NonFiniteGuard, *,
                overlap: bool) -> tuple[float, Callable[[], None]]:
    """One training step's batch, forward and backward: its loss, and the strategy's update
    to run next. ``overlap``: DDP may send gradients during the backward pass (not in an
    elastic run, whose communication all happens in the update's transaction)."""
    cfg, strategy = run.job.config, run.strategy
    loss = 0.0
    indices = run.batches.next_indices()
    micros = list(split_microbatches(indices, cfg.microbatch_size))
    if overlap and sole_backward(cfg, len(micros)):  # DDP: gradients on the wire during backward
        strategy.before_sole_backward(step)
    for micro in micros:
        batch = to_device(fetch(run.train_set, micro, run.job.collate_fn), run.device)
        loss += _forward_backward(run, batch, weight=len(micro) / len(indices))
    if run.scaler is not None:  # fp16: the gradients back to their true size
        run.scaler.unscale(strategy.params)
    skip = guard.skips(run, step, loss)

    def update() -> None:
        with run.clock:
            if skip:
                strategy.skip_step(step)
            else:
                strategy.step(step)  # the update, and this step's communication

    return loss, update


def sole_backward(cfg: TrainConfig, microbatches: int) -> bool:
    """Whether a step's backward pass is its only one and the strategy's step follows it
    with the gradients as they are: no microbatches still to add, no fp16 unscaling, no
    non-finite vote (a collective) and no recomputation (whose hooks may fire twice)."""
    return microbatches == 1 and cfg.precision != "fp16" and not cfg.skip_nonfinite \
        and not cfg.gradient_checkpointing


def _forward_backward(run: NodeRun, batch: Any, *, weight: float) -> float:
    """One (micro)batch's forward and backward, its gradients added with ``weight``; its
    loss times ``weight``."""
    precision, checkpointed = run.job.config.precision, run.job.config.gradient_checkpointing
    with run.clock:
        with run.rng_guard() if run.rng_guard is not None else nullcontext(), \
                memory.autocast(precision, run.device):
            loss = run.model(batch)
        scale = run.scaler.scale if run.scaler else 1.0
        # A checkpointed backward pass reruns the forward's dropout: the node's stream again.
        with run.rng_guard() if run.rng_guard is not None and checkpointed else nullcontext():
            # Times 1 changes no bit: one batch in fp32 skips two operations and their backward.
            (loss if weight == scale == 1.0 else loss * weight * scale).backward()
        return loss.item() * weight


def _start_node(job: NodeJob, comm: Communicator, rng_guard: RngGuard | None,
                verify_replicas: bool) -> NodeRun:
    """This node's model, data, step count and strategy, set up and agreed with its peers."""
    cfg, rank = job.config, comm.rank
    device = resolve_device(cfg.device)
    model = node_replica(job.model, device)
    model.train()
    if cfg.gradient_checkpointing:
        memory.enable_checkpointing(model)
    train_set, shard = resolve_dataset(job.train_data, rank, cfg.nodes, "train")
    batches: NodeBatches | SharedBatches
    if isinstance(comm, ElasticCommunicator) and shard:  # members change: one order, shared out
        batches = SharedBatches(train_set, slot=rank, slots=cfg.nodes, batch_size=cfg.batch_size,
                                seed=cfg.seed, shuffle=cfg.shuffle)
    else:
        batches = NodeBatches(train_set, rank=rank, nodes=cfg.nodes, batch_size=cfg.batch_size,
                              seed=cfg.seed, shuffle=cfg.shuffle, shard=shard)
    comm.step = -1  # start-up traffic
    max_steps = cfg.steps or _agreed_epoch_steps(cfg.epochs, len(batches), comm)  # type: ignore[arg-type]
    plan = cfg.fault_plan()
    check_steps(plan, max_steps)  # with epochs, the step count is known only now
    strategy = copy.deepcopy(job.strategy)
    if verify_replicas:  # a large model's hashing takes a while: say so when it does
        with Status(enabled=cfg.progress and rank == 0).phase(
                "checking that every host holds the same weights (hashing them)", after=HASH_NOTICE_AFTER_S):
            _verify_replicas(model, comm)
    strategy.setup(model, comm, seed=cfg.seed, max_steps=max_steps, num_samples=len(batches.indices))
    try:  # simulated nodes' speeds come from --straggler; launched ones measure their own
        strategy.use_node_speeds(None if cfg.runtime == "launched" else
                                 [1.0 / plan.stragglers.get(r, 1.0) for r in range(cfg.nodes)])
    except ValueError as exc:
        raise SettingError(f"strategy {strategy.name}: {exc}") from None
    work = strategy.relative_work()
    if work is not None:  # the projection counts each node's compute per loop step
        plan = dataclasses.replace(plan, work=work)
    # --balance: each node's share of the step's samples (engine/balance.py)
    balancer = balance.Balancer(comm, cfg.nodes, cfg.batch_size, measured=cfg.runtime == "launched",
                                stragglers=plan.stragglers, sync_interval=strategy.sync_interval()) \
        if cfg.balance else None
    if balancer is not None:
        assert isinstance(batches, NodeBatches)  # --balance is refused with --elastic
        balancer.start(batches, strategy)
        if balancer.shares is not None:  # the projection counts each node's work
            plan = dataclasses.replace(plan, work=balancer.shares.work(cfg.batch_size))
    # A node's kernels run on its own thread at one intra-op thread on CPU: time it by that
    # thread's CPU time (ComputeClock).
    clock = ComputeClock(comm, own_thread=device.type == "cpu" and cfg.threads == 1)
    return NodeRun(job=job, comm=comm, model=model, strategy=strategy, train_set=train_set,
                   batches=batches, device=device, max_steps=max_steps, plan=plan, clock=clock,
                   rng_guard=rng_guard, startup_sent=comm.log.bytes_sent, balancer=balancer,
                   # fp16 needs its loss scaled, and an overflow skips the step on every node alike.
                   scaler=memory.LossScaler() if cfg.precision == "fp16" else None)


def _resume(run: NodeRun) -> None:
    """Continue from the checkpoint ``run.job.resume``: this node's model, strategy, data
    position, random stream, communication log and history so far."""
    job, cfg = run.job, run.job.config
    assert job.resume is not None
    saved = checkpoint.load_node(job.resume, run.rank)
    source = f"{job.resume.folder}/node-{job.resume.source_rank(run.rank)}.pt"
    checkpoint.load_model_state(run.model, saved, source)
    run.strategy.load_state_dict(saved["strategy"])
    shrunk = job.resume.nodes != cfg.nodes
    # On fewer nodes the shards are cut anew, so a saved position means nothing there:
    # the new shards start a fresh epoch (the lost node's samples are in them).
    run.batches.load_state_dict({"epoch": saved["data"]["epoch"] + 1, "position": 0} if shrunk
                                else saved["data"])
    set_node_rng_state(saved["rng"], run.rng_guard, run.device)
    run.comm.log = CommLog([CommRecord(*r) for r in saved["comm"]], *saved["comm_totals"])
    run.losses, run.seconds, run.history_val = list(saved["losses"]), list(saved["seconds"]), saved["val"]
    run.skipped = list(saved["skipped"])
    run.idle_steps = list(saved.get("idle_steps", []))
    run.initial, run.startup_sent = saved["initial"], saved["startup_sent"]
    run.first_step, run.loop_before = saved["step"], saved["loop_seconds"]
    run.seconds_before = run.seconds[-1] if run.seconds else 0.0
    if shrunk:  # the global state came from each survivor's own file: prove it is one state
        check_sync(run.strategy, run.comm, run.first_step - 1)


def _callbacks(run: NodeRun, validation: Validation) -> list[Callback]:
    """The callbacks of this run, in the order every node calls them; and its progress bar
    and loggers (rank 0), which some of them feed."""
    job, cfg = run.job, run.job.config
    run.progress = Progress(run.max_steps, enabled=cfg.progress and run.rank == 0, title=run.strategy.name,
                            began=job.began, first_step=run.first_step)
    run.live = loggers.RunLoggers.for_run(job, run.strategy, run.initial) if run.rank == 0 \
        else loggers.RunLoggers()
    status = StatusReport(run)
    balancing: list[Callback] = [Balancing(run, status)] if run.balancer is not None else []
    return [Faults(status), SyncCheck(), *balancing, status, validation, Checkpointing(), ProgressReport(run)]


def _report(run: NodeRun, final: dict[str, float], elastic: ElasticNode | None = None) -> FitResult:
    """Every node sends rank 0 its report; rank 0 writes the run."""
    comm = run.comm
    box: list[list[Any] | None] = [None]

    def gather() -> None:
        box[0] = comm.gather_json(asdict(run.report()))

    comm.transaction(gather, snapshot=dict, restore=lambda saved: None, admit=False, step=run.max_steps - 1)
    gathered = box[0]
    if comm.rank != 0:
        return FitResult(model=run.model, history=[], run_dir=None, summary={})
    assert gathered is not None
    by_rank = {**run.departed, **{r: NodeReport(**g) for r, g in zip(comm.alive, gathered, strict=True)}}
    # An elastic run's slot whose process is gone at the end has no report: no loss of its own.
    # Hosts added to an elastic run while it trained are slots past the launch's nodes.
    slots = max(run.job.config.nodes, comm.table.slots if isinstance(comm, ElasticCommunicator) else 0)
    reports = [by_rank.get(r) or placeholder_report(run.max_steps) for r in range(slots)]
    return finish_run(run.job, run.strategy, run.model, comm.log.records, reports,
                      history_val=run.history_val, initial=run.initial, final=final,
                      skipped=run.skipped, steps=run.max_steps, plan=run.plan, live=run.live,
                      log_lines=run.progress.lines,
                      balance=run.balancer.to_dict() if run.balancer is not None else None,
                      measured_communication_seconds=comm.log.seconds,
                      elastic=_elastic_record(comm, elastic))


def _elastic_record(comm: Communicator, elastic: ElasticNode | None) -> dict[str, Any] | None:
    """Rank 0's account of an elastic run: who was in at every step, and every change."""
    if elastic is None or not isinstance(comm, ElasticCommunicator):
        return None
    return {"members_by_step": elastic.members_by_step, "events": comm.events, "heal_bytes": comm.heal_bytes,
            "rejoins": elastic.rejoins,
            "final_members": list(comm.alive), "slots": comm.table.slots,
            "added": [{"rank": g.slot, "host": g.name} for g in comm.table.added]}


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
    digests = torch.stack([digest(frozen), digest(trainable)])
    everyone = comm.all_gather(digests, record=False)
    for rank, theirs in enumerate(everyone):
        if not torch.equal(theirs[0], everyone[0][0]):
            raise RuntimeError(
                f"frozen weights on node {rank} differ from node 0: load the same base "
                "checkpoint on every host"
            )
    if any(not torch.equal(theirs[1], everyone[0][1]) for theirs in everyone):
        comm.broadcast([p.data for p in trainable], src=0)
