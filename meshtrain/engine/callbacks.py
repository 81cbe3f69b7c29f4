"""What a node does around its training step, one job per class.

The loop (:mod:`meshtrain.engine.loop`) runs the step itself; these callbacks hear of
every step's start and end and of the end of training. Every node runs the same
callbacks in the same order, so the collectives they make (sync checks, validation,
checkpoint hashes, progress numbers) meet across nodes. None of those is recorded: the
bytes of a run are its strategy's alone.
"""

from __future__ import annotations

import copy
import hashlib
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import asdict, astuple, dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch import nn

from meshtrain import checkpoint, observers, seeding
from meshtrain.comm import Communicator
from meshtrain.config.resume import recorded_settings
from meshtrain.data import NodeBatches, SharedBatches, fetch, resolve_dataset, to_device
from meshtrain.engine import loggers
from meshtrain.engine.balance import Balancer
from meshtrain.engine.job import NodeJob
from meshtrain.engine.memory import LossScaler
from meshtrain.engine.report import NodeReport, bytes_per_step
from meshtrain.errors import RunFailure
from meshtrain.faults import FaultPlan
from meshtrain.heartbeat import StatusReporter, status_reporter
from meshtrain.progress import Progress, Status
from meshtrain.strategies import Strategy

RngGuard = Callable[[], Any]


class ComputeClock:
    """Seconds one node spends computing: forward, backward and the optimizer, never the
    runtime's own work or time inside collectives (waiting for peers included).

    A node whose kernels run on its own thread (``threads`` = 1 on CPU, the default of the
    local runtimes) is timed by that thread's CPU time, which other nodes sharing the cores
    do not inflate; otherwise (several intra-op threads, an accelerator) by wall time.
    Used as ``with clock:`` around the computing parts of a step.

    The node's first step is kept apart (``first_step_seconds``): it pays one-off costs
    (the optimizer's state, the allocator's first pages, lazy kernel set-up) that took ~5x
    a later step of the benchmark MLP, and a projection of a long run needs the steady step.
    """

    def __init__(self, comm: Communicator, *, own_thread: bool) -> None:
        self.now: Callable[[], float] = time.thread_time if own_thread else time.perf_counter
        self.comm = comm
        comm.collective_clock = self.now  # collectives inside a timed part are taken out
        self.seconds = 0.0
        self.first_step_seconds: float | None = None  # set by first_step_done()
        self._started = self._in_collectives = 0.0

    def first_step_done(self) -> None:
        """The node's first step is over: what was timed so far is its warm-up."""
        if self.first_step_seconds is None:
            self.first_step_seconds = self.seconds

    def steady(self, steps: int) -> tuple[float, int]:
        """(compute seconds, steps they cover) of ``steps`` steps taken: without the first
        one where a later one was timed."""
        if self.first_step_seconds is None or steps < 2:
            return self.seconds, steps
        return self.seconds - self.first_step_seconds, steps - 1

    def __enter__(self) -> None:
        self._in_collectives = self.comm.collective_clock_seconds
        self._started = self.now()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        collectives = self.comm.collective_clock_seconds - self._in_collectives
        self.seconds += self.now() - self._started - collectives


@dataclass
class NodeRun:
    """One node's training run: what the loop and its callbacks share."""

    job: NodeJob
    comm: Communicator
    model: nn.Module
    strategy: Strategy
    train_set: Any
    batches: NodeBatches | SharedBatches
    device: torch.device
    max_steps: int
    plan: FaultPlan
    clock: ComputeClock
    rng_guard: RngGuard | None = None
    startup_sent: int = 0  # bytes sent before the first step (replica checks, strategy setup)
    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # since the run started, per step
    history_val: dict[int, dict[str, float]] = field(default_factory=dict)
    skipped: list[int] = field(default_factory=list)  # steps skipped for a non-finite loss
    idle_steps: list[int] = field(default_factory=list)  # 0-based loop steps it did not train in
    departed: dict[int, NodeReport] = field(default_factory=dict)  # rank 0: nodes that left
    initial: dict[str, float] = field(default_factory=dict)  # the global model before step 1
    first_step: int = 0
    seconds_before: float = 0.0  # a resumed run's seconds before this session
    loop_before: float = 0.0  # and its training-loop seconds
    loop_started: float = 0.0
    collectives_before: float = 0.0  # comm.log.seconds when the loop started
    balancer: Balancer | None = None  # --balance: this node's share of each step's samples
    scaler: LossScaler | None = None  # precision fp16: the loss scale
    progress: Progress = field(default_factory=lambda: Progress(0, enabled=False, title=""))
    live: loggers.RunLoggers = field(default_factory=loggers.RunLoggers)

    @property
    def rank(self) -> int:
        return self.comm.rank

    def report(self) -> NodeReport:
        """What this node sends rank 0 about the steps it took."""
        in_collectives = self.comm.log.seconds - self.collectives_before
        looped = time.perf_counter() - self.loop_started
        trained = len(self.losses) - self.first_step - sum(s >= self.first_step for s in self.idle_steps)
        return NodeReport(self.losses, self.seconds, *bytes_per_step(self.comm, self.max_steps),
                          self.startup_sent, *self.clock.steady(trained),
                          in_collectives / looped if looped > 0 else None,
                          self.balancer.collective_share() if self.balancer is not None else None,
                          self.idle_steps)


class Callback:
    """One job around the node loop. Every hook is optional."""

    def step_start(self, run: NodeRun, step: int) -> bool:
        """Before 0-based ``step``; False makes this node leave the run here."""
        return True

    def step_end(self, run: NodeRun, step: int) -> None:
        """After ``step``'s update, its loss in ``run.losses[-1]``."""

    def train_end(self, run: NodeRun) -> None:
        """After the strategy's final sync."""


# ------------------------------------------------------------------- --balance
class Balancing(Callback):
    """``--balance``: after each step the balancer may give this node a new share of the
    step's samples (:mod:`meshtrain.engine.balance`); the watchers are told."""

    def __init__(self, run: NodeRun, status: StatusReport) -> None:
        assert run.balancer is not None
        self.balancer, self.status = run.balancer, status
        status.show_batch_size(run.batches.batch_size)

    def step_end(self, run: NodeRun, step: int) -> None:
        assert isinstance(run.batches, NodeBatches)  # --balance is refused with --elastic
        if self.balancer.step_done(step, run.batches, run.strategy):
            self.status.show_batch_size(run.batches.batch_size)


# ------------------------------------------------------------------- status and progress
class StatusReport(Callback):
    """Tells watchers where this node is: the launcher's live view (a launched rank's
    status frames, :mod:`meshtrain.heartbeat`) and the observers of this process (the live
    dashboard of ``simulate --dashboard``)."""

    def __init__(self, run: NodeRun) -> None:
        cfg = run.job.config
        self.status: StatusReporter | None = \
            status_reporter(run.max_steps, run.first_step) if cfg.runtime == "launched" else None
        self.watched = observers.NodeReporter(run.rank, run.max_steps, own_thread=cfg.runtime == "threads") \
            if observers.active() else None

    def step_end(self, run: NodeRun, step: int) -> None:
        loss, sent = run.losses[-1], run.comm.log.bytes_sent
        if self.status is not None:
            self.status.step_done(step + 1, loss, sent, run.strategy)
        if self.watched is not None:
            self.watched.step_done(step + 1, loss, sent)

    def show_batch_size(self, batch_size: int) -> None:
        """The live view and the dashboard show each node's share under --balance."""
        for reporter in (self.status, self.watched):
            if reporter is not None:
                reporter.batch_size = batch_size

    def last_word(self, run: NodeRun, step: int) -> None:
        """A node leaving at ``step`` says so (``--fail``)."""
        if self.watched is not None:
            self.watched.step_done(step, run.losses[-1] if run.losses else None, run.comm.log.bytes_sent,
                                   final=True)

    def train_end(self, run: NodeRun) -> None:  # with the final sync's bytes
        last = run.losses[-1] if run.losses else None
        if self.status is not None:
            self.status.step_done(run.max_steps, last, run.comm.log.bytes_sent, run.strategy, final=True)
        if self.watched is not None:
            self.watched.step_done(run.max_steps, last, run.comm.log.bytes_sent, final=True)


class ProgressNumbers:
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


class ProgressReport(Callback):
    """The progress bar (rank 0) and the metrics loggers (CSV, TensorBoard, W&B), which get
    the bar's numbers on its schedule; every node takes part in collecting them."""

    def __init__(self, run: NodeRun) -> None:
        cfg = run.job.config
        self.numbers = ProgressNumbers(run.comm, run.startup_sent, run.max_steps,
                                       lines_only=cfg.runtime == "launched" and not loggers.wanted(cfg)) \
            if cfg.progress or loggers.wanted(cfg) else None

    def step_end(self, run: NodeRun, step: int) -> None:
        if self.numbers is not None and self.numbers.due(step):
            mean_loss_now, sent_now = self.numbers.collect(run.losses[-1])
            run.progress.update(step + 1, mean_loss_now, sent_now)
            run.live.log({"train_loss": mean_loss_now, "total_bytes_sent": sent_now}, step + 1)

    def train_end(self, run: NodeRun) -> None:
        if self.numbers is not None:  # the final sync's bytes count too
            run.progress.update(run.max_steps, *self.numbers.collect(run.losses[-1]))


# ------------------------------------------------------------------------------ guards
class NonFiniteLoss(RunFailure):
    """A node's loss became NaN or infinite: the run stops, naming the step and node."""


class NonFiniteGuard(Callback):
    """A NaN or infinite loss or gradient stops the run, naming the step and node; with
    ``skip_nonfinite`` the step is skipped on every node instead (they agree by one
    unrecorded max-reduce of a flag)."""

    def skips(self, run: NodeRun, step: int, loss: float) -> bool:
        """Whether ``step`` must be skipped (raises :class:`NonFiniteLoss` unless skipping)."""
        problem = _non_finite(loss, run.strategy.params)
        if run.job.config.skip_nonfinite or run.scaler is not None:
            flag = torch.tensor([0.0 if problem is None else 1.0], dtype=torch.float64)
            run.comm.all_reduce(flag, op="max", record=False)
            skip = bool(flag.item())
            if run.scaler is not None:  # an fp16 overflow: a smaller scale, the step skipped
                run.scaler.update(skip)
        elif problem is not None:
            raise NonFiniteLoss(f"{problem} at step {step + 1} on node {run.rank}")
        else:
            skip = False
        if skip:
            run.skipped.append(step + 1)
            if run.rank == 0:
                observers.notify("event", "nonfinite", f"step {step + 1} skipped: a node's loss or "
                                 "parameters were not finite (--skip-nonfinite)")
        return skip


def _non_finite(loss: float, params: Sequence[torch.Tensor]) -> str | None:
    """What is NaN or infinite this step (the loss, else a gradient), or None."""
    if not math.isfinite(loss):
        return f"loss is {loss}"
    grads = [p.grad for p in params if p.grad is not None and p.grad.numel()]
    # Every 2-norm finite means every gradient is (a NaN or infinity propagates into its
    # norm): one list operation, 1/3 of the time of the exact check below for the gpt
    # model's 28 tensors. A norm that is not finite may also be finite values whose squares
    # overflow, so only then the exact check: a gradient's min and max are both finite
    # exactly when all of it is (a max never overflows).
    if not grads or bool(torch.stack(torch._foreach_norm(grads, 2)).isfinite().all()):
        return None
    if not bool(torch.stack([end for g in grads for end in torch.aminmax(g)]).isfinite().all()):
        return "a gradient is not finite"
    return None


class ReplicaDrift(RunFailure):
    """Nodes that a strategy keeps identical were found to differ (``check_sync``)."""


class SyncCheck(Callback):
    """``check_sync``: after every step, and after the final sync, compare by SHA-256 what
    the strategy promises is identical on its nodes."""

    def step_end(self, run: NodeRun, step: int) -> None:
        if run.job.config.check_sync:
            check_sync(run.strategy, run.comm, step)

    def train_end(self, run: NodeRun) -> None:
        if run.job.config.check_sync:
            check_sync(run.strategy, run.comm, run.max_steps - 1)


def check_sync(strategy: Strategy, comm: Communicator, step: int) -> None:
    """Raise :class:`ReplicaDrift` if what ``strategy`` keeps identical after ``step`` is not."""
    promised = strategy.synced(step)
    if promised is None:
        return
    tensors, group = promised
    members = comm.members(group)
    digests = comm.all_gather(digest(tensors), group=group, record=False)
    differ = [m for m, d in zip(members, digests, strict=True) if not torch.equal(d, digests[0])]
    if differ:
        raise ReplicaDrift(f"after step {step + 1}, node(s) {', '.join(map(str, differ))} hold "
                           f"parameters that differ from node {members[0]}'s, although "
                           f"{strategy.name} keeps them identical")


def digest(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """SHA-256 of the tensors' bytes, as 32 uint8s (a tensor peers can compare)."""
    h = hashlib.sha256()
    for p in params:
        # reshape(-1): a 0-dim tensor (a learnable scalar) has no byte view of its own.
        h.update(p.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8)


# --------------------------------------------------------------------------------- faults
class Faults(Callback):
    """``--fail``: at the start of a step where the plan removes nodes, they leave.

    Every node of the old membership meets once more: each leaving node hands rank 0 its
    report (unrecorded: a real failure would lose it, but the simulation keeps the losses
    and bytes of the steps it took). Then the survivors go on among themselves.
    """

    def __init__(self, status: StatusReport) -> None:
        self.status = status

    def step_start(self, run: NodeRun, step: int) -> bool:
        plan, comm = run.plan, run.comm
        if not plan.failures:
            return True
        now = plan.alive_at(step, comm.world_size)
        if now == comm.alive:
            return True
        leaving = run.rank not in now
        if leaving:
            self.status.last_word(run, step)
        gathered = comm.gather_json(asdict(run.report()) if leaving else None)
        if gathered is not None:  # rank 0
            gone = [r for r in comm.alive if r not in now]
            for r, value in zip(comm.alive, gathered, strict=True):
                if r in gone:
                    run.departed[r] = NodeReport(**value)
            self._announce(run, step, gone, now)
        comm.set_alive(now)
        return not leaving

    @staticmethod
    def _announce(run: NodeRun, step: int, gone: list[int], now: list[int]) -> None:
        names, s = ", ".join(map(str, gone)), "s" if len(gone) > 1 else ""
        run.progress.note(f"step {step}/{run.max_steps}  node{s} {names} left "
                          f"(--fail); {len(now)} node{'s' if len(now) > 1 else ''} go on")
        for r in gone:
            observers.notify("node_ended", r, "lost", f"left at step {step} (--fail)")
        observers.notify("event", "left", f"step {step}: node{s} {names} left (--fail); {len(now)} go on")


# ----------------------------------------------------------------------------- validation
class Validation(Callback):
    """Validation every ``val_interval`` steps: the global model's metrics (rank 0's scratch
    copy of the model, loaded with the global parameters) and the mean of the node models'
    validation losses; also the global model before the first step and after the last."""

    def __init__(self, job: NodeJob, model: nn.Module, rank: int, device: torch.device,
                 check_abort: Callable[[], None]) -> None:
        self.batches = _StoppableBatches(_validation_batches(job, rank, device), check_abort)
        self.evaluator = _GlobalEvaluator(model, self.batches) if rank == 0 and self.batches else None

    def evaluate_global(self, strategy: Strategy) -> dict[str, float]:
        """The global model's metrics (rank 0; empty elsewhere or without validation data)."""
        return self.evaluator.evaluate(strategy.params_data()) if self.evaluator else {}

    def evaluate_untrained(self, strategy: Strategy, *, shown: bool) -> dict[str, float]:
        """The global model's metrics before step 1; announced when they include a word
        error rate, whose decoding takes a while (a loss alone takes about a step)."""
        if self.evaluator is None:
            return {}
        n = len(self.batches)
        announce = shown and self._measures_wer()
        with Status(enabled=announce).phase(f"measuring the untrained model's validation loss and "
                                            f"word error rate ({n} batch{'es' if n != 1 else ''})"):
            return self.evaluate_global(strategy)

    def step_end(self, run: NodeRun, step: int) -> None:
        interval = run.job.config.val_interval
        last = step == run.max_steps - 1
        if interval and (step + 1) % interval == 0 and not last and self.batches:
            # A word error rate decodes every batch: the bar would stand still without a word.
            n = len(self.batches)
            with Status(enabled=self._measures_wer(), say=run.progress.note).phase(
                    f"validating at step {step + 1}/{run.max_steps}: loss and word error rate "
                    f"({n} batch{'es' if n != 1 else ''})"):
                run.history_val[step] = self._validate(run)
            run.live.log(run.history_val[step], step + 1)

    def _measures_wer(self) -> bool:
        return self.evaluator is not None and bool(getattr(self.evaluator.model, "measures_wer", False))

    def _validate(self, run: NodeRun) -> dict[str, float]:
        global_params = run.strategy.global_parameters()
        node_loss = torch.tensor([mean_loss(run.model, self.batches)], dtype=torch.float64)
        run.comm.all_reduce(node_loss, op="mean", record=False)
        out = self.evaluator.evaluate(global_params) if self.evaluator else {}
        out["node_val_loss"] = float(node_loss)
        return out


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


class _StoppableBatches(list[Any]):
    """The validation batches; each batch taken from them first checks that the run goes on.

    A pass over a large validation set (a word error rate decodes every batch) can outlast
    the grace a stopping run gives its nodes: a Ctrl-C or a failed peer must stop it at the
    next batch, in ``mean_loss`` and in a model's own ``validation_metrics`` alike.
    """

    def __init__(self, batches: list[Any], check_abort: Callable[[], None]) -> None:
        super().__init__(batches)
        self.check_abort = check_abort

    def __iter__(self) -> Iterator[Any]:
        for batch in super().__iter__():
            self.check_abort()
            yield batch


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


_moving = threading.Lock()


def node_replica(model: nn.Module, device: torch.device | None = None) -> nn.Module:
    """A node's own copy of ``model`` (on ``device``) that shares its frozen parameters.

    Frozen weights never change, so the nodes of one process (and rank 0's evaluator)
    hold one copy of them: under LoRA that is nearly the whole model. Everything that
    trains, and every buffer, is the node's own.

    With a ``device``, ``model`` itself moves there first, whole, as Hugging Face's Trainer
    moves the model it is given: its frozen weights then live on the device once for all
    nodes. (Moving only the copy would move the shared frozen parameters alone, leaving the
    caller's model half on the GPU and half on the CPU.)
    """
    if device is not None:
        with _moving:  # the threads runtime's nodes start at once: one moves, the rest find it moved
            model.to(device)
    frozen = {id(p): p for p in model.parameters() if not p.requires_grad}
    return copy.deepcopy(model, memo=dict(frozen))


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


# ---------------------------------------------------------------------------- checkpoints
class Checkpointing(Callback):
    """Every ``checkpoint_every`` steps (not after the last), every node saves its state;
    rank 0 publishes the checkpoint once all have (a launched rank publishes its own)."""

    def step_end(self, run: NodeRun, step: int) -> None:
        every = run.job.config.checkpoint_every
        if every and (step + 1) % every == 0 and step != run.max_steps - 1:
            self.save(run, step + 1)

    def save(self, run: NodeRun, steps_done: int) -> None:
        job, cfg, comm = run.job, run.job.config, run.comm
        assert job.checkpoints is not None
        digest_hex = checkpoint.save_node(job.checkpoints, steps_done, run.rank, self._state(run, steps_done))
        hashes = comm.gather_json({"rank": run.rank, "sha256": digest_hex})  # also: every node has saved
        settings = recorded_settings(cfg, run.strategy)  # what a resume is checked against
        if cfg.runtime == "launched":  # every host keeps its own rank's checkpoint
            checkpoint.commit(job.checkpoints, steps_done, job.run_id, {run.rank: digest_hex},
                              cfg.keep_checkpoints, cfg.nodes, settings)
        elif hashes is not None:
            checkpoint.commit(job.checkpoints, steps_done, job.run_id,
                              {h["rank"]: h["sha256"] for h in hashes}, cfg.keep_checkpoints, cfg.nodes,
                              settings)

    @staticmethod
    def _state(run: NodeRun, steps_done: int) -> dict[str, Any]:
        log = run.comm.log
        return {
            "run_id": run.job.run_id, "step": steps_done, "rank": run.rank,
            **checkpoint.model_state(run.model), "strategy": run.strategy.state_dict(),
            "data": run.batches.state_dict(), "rng": node_rng_state(run.rng_guard, run.device),
            "comm": [astuple(r) for r in log.records],
            "comm_totals": [log.bytes_sent, log.bytes_received, log.seconds],
            "losses": run.losses, "seconds": run.seconds, "val": run.history_val, "initial": run.initial,
            "skipped": run.skipped, "idle_steps": run.idle_steps,
            "startup_sent": run.startup_sent,
            "loop_seconds": run.loop_before + time.perf_counter() - run.loop_started,
        }


def node_rng_state(rng_guard: RngGuard | None, device: torch.device) -> seeding.RandomState:
    """This node's random stream (in the threads runtime it lives behind the guard)."""
    with rng_guard() if rng_guard is not None else nullcontext():
        return seeding.current_state(device)


def set_node_rng_state(state: seeding.RandomState | torch.Tensor, rng_guard: RngGuard | None,
                       device: torch.device) -> None:
    with rng_guard() if rng_guard is not None else nullcontext():
        seeding.restore_state(state, device)
