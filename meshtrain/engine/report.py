"""Rank 0's report of a run: per-step history, the summary, the projection onto a
cluster, and the run directory (config, metrics, log, model, plot, summary, provenance).

Everything here runs once, after the last step, on what the nodes sent rank 0
(:class:`NodeReport`); none of it talks to the other nodes.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshtrain import observers
from meshtrain.cluster import BACKWARD_SHARE, Cluster, communication_by_step, get_cluster, project, sync_waits
from meshtrain.comm import Communicator
from meshtrain.comm.communicator import CommRecord
from meshtrain.engine import loggers
from meshtrain.engine.job import FitResult, NodeJob
from meshtrain.faults import FaultPlan
from meshtrain.run_dir import RunDirectory
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
    # Seconds this node spent computing (forward, backward, optimizer; collectives excluded)
    # over ``compute_steps`` steps, the first one left out: see
    # :class:`meshtrain.engine.callbacks.ComputeClock`.
    compute_seconds: float = 0.0
    compute_steps: int = 0
    # Share of its training loop's wall time inside recorded collectives (waiting for the
    # slowest node, plus the transfer), and the same since its --balance share took effect.
    collective_share: float | None = None
    balanced_collective_share: float | None = None
    # 0-based loop steps this node did not train in (async-diloco's slower nodes).
    idle_steps: list[int] = field(default_factory=list)


def finish_run(job: NodeJob, strategy: Strategy, model: nn.Module, records: list[CommRecord],
               reports: list[NodeReport], *, history_val: dict[int, dict[str, float]],
               initial: dict[str, float], final: dict[str, float], skipped: list[int], steps: int,
               plan: FaultPlan, live: loggers.RunLoggers, log_lines: list[str],
               balance: dict[str, Any] | None = None,
               measured_communication_seconds: float | None = None,
               elastic: dict[str, Any] | None = None) -> FitResult:
    """Rank 0, after the last step: the history and summary from every node's report, the
    projection, the loggers' last word and the run directory. ``elastic``: an elastic
    run's membership (:func:`meshtrain.engine.loop._elastic_record`)."""
    cfg = job.config
    members = None
    if elastic is not None:
        by_step = elastic["members_by_step"]
        members = {steps - len(by_step) + i: m for i, m in enumerate(by_step)}
    history = history_rows(job, strategy, reports, history_val, final, steps, plan, members)
    summary = run_summary(job, strategy, history, final, reports, model)
    if plan:
        summary["faults"] = plan.to_dict()
    summary["collective_share_per_node"] = [_rounded(r.collective_share) for r in reports]
    if balance is not None:
        summary["balance"] = {**balance, "collective_share_per_node": [
            _rounded(r.balanced_collective_share) for r in reports]}
    if elastic is not None:
        summary["elastic"] = elastic_summary(elastic, elastic.get("slots", cfg.nodes))
    summary["initial"] = initial
    summary["skipped_steps"] = len(skipped)
    if cfg.skip_nonfinite:
        skipped_steps = set(skipped)
        for row in history:
            row["skipped"] = int(row["step"] in skipped_steps)
    summary["projected"] = projection(job, records, reports, steps, plan, measured_communication_seconds)
    add_projected_seconds(history, records, get_cluster(cfg.cluster), summary["projected"]["step_seconds"],
                          [plan.slowdown_at(s, cfg.nodes) for s in range(steps)])
    with live.closed_on_failure():  # before the run directory is committed (TensorBoard's files)
        live.finish(history[-1], summary)
    run_dir = write_run(job, strategy, model, history, summary, log_lines)
    observers.notify("run_finished", summary, history)
    return FitResult(model=model, history=history, run_dir=run_dir, summary=summary)


def _rounded(share: float | None) -> float | None:
    return None if share is None else round(share, 4)


def bytes_per_step(comm: Communicator, steps: int) -> tuple[list[int], list[int]]:
    sent, received = [0] * steps, [0] * steps
    for r in comm.log.records:
        if 0 <= r.step < steps:
            sent[r.step] += r.bytes_sent
            received[r.step] += r.bytes_received
    return sent, received


def history_rows(
    job: NodeJob,
    strategy: Strategy,
    reports: list[NodeReport],
    val: dict[int, dict[str, float]],
    final: dict[str, float],
    steps: int,
    plan: FaultPlan | None = None,
    members: dict[int, list[int]] | None = None,
) -> list[dict[str, Any]]:
    """Per-step records: losses averaged over the step's nodes (alive ones, with ``--fail``;
    in an elastic run the ``members`` of each step, whose work reached the global model:
    then a ``members`` column names them) that trained in it (async-diloco's slower nodes
    skip loop steps; where none trained, the row keeps the last mean), bytes as their
    per-node mean; ``reports`` holds every node's, by rank."""
    plan = plan or FaultPlan()
    history: list[dict[str, Any]] = []
    total_sent = total_received = 0.0
    examples = 0
    idle = [set(r.idle_steps) for r in reports]
    train_loss = math.nan
    for step in range(steps):
        ranks = members.get(step, list(range(len(reports)))) if members is not None \
            else plan.alive_at(step, len(reports))
        alive = [reports[r] for r in ranks]
        n = len(alive)
        # An elastic run's member whose process is gone at the end (lost, or its run before
        # it rejoined) left no loss of its own (NaN): the step's loss is the others'.
        trained = [reports[r] for r in ranks
                   if step not in idle[r] and math.isfinite(reports[r].losses[step])]
        sent = sum(r.bytes_sent[step] for r in alive) / n
        received = sum(r.bytes_received[step] for r in alive) / n
        total_sent += sent
        total_received += received
        examples += job.config.batch_size * len(trained)
        if trained:
            train_loss = sum(r.losses[step] for r in trained) / len(trained)
        row: dict[str, Any] = {
            "step": step + 1,
            "nodes": n,
            "train_loss": train_loss,
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
        if members is not None:
            row["members"] = " ".join(map(str, ranks))
        row.update(val.get(step, {}))
        history.append(row)
    if final:
        history[-1].update(final)
        history[-1]["node_val_loss"] = final["val_loss"]
    return history


def elastic_summary(elastic: dict[str, Any], slots: int) -> dict[str, Any]:
    """summary.json's ``elastic``: every change of membership, the bytes healing cost, the
    slots in at the end, those lost for good, and the hosts added while it trained
    (``meshtrain hosts add``: their ranks are slots past the launch's)."""
    final = list(elastic["final_members"])
    return {"events": elastic["events"], "heal_bytes": elastic["heal_bytes"], "final_members": final,
            "lost_for_good": [s for s in range(slots) if s not in final], "added": elastic.get("added", []),
            "rejoins": elastic.get("rejoins", [])}


def peak_bytes_per_sync(history: list[dict[str, Any]]) -> float:
    """The most bytes a node sent in one step's collectives: what one sync needs of the link
    at once (streaming DiLoCo's fragment against DiLoCo's whole model). The last step is left
    out where there are others: strategies whose nodes drift apart end with a full sync."""
    rows = history[:-1] or history
    return max((row.get("bytes_sent") or 0 for row in rows), default=0)


def run_summary(
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
        "peak_bytes_sent_per_sync": peak_bytes_per_sync(history),
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


def projection(job: NodeJob, records: list[CommRecord], reports: list[NodeReport], steps: int,
               plan: FaultPlan | None = None, measured_communication_seconds: float | None = None
               ) -> dict[str, Any]:
    """Rank 0's collectives and the nodes' compute, replayed on the configured cluster.

    The compute of one step (``step_seconds``) is ``cfg.step_seconds`` if given, else the
    nodes' measured compute (forward, backward, optimizer; never the runtime's own work or
    time in collectives) per step taken, over every node. With stragglers a step's compute
    is its slowest alive node's (``step_seconds`` times the largest slowdown), and
    ``idle_seconds`` adds up, over steps and nodes, how long the faster nodes wait for it.
    """
    cfg = job.config
    plan = plan or FaultPlan()
    step_seconds = cfg.step_seconds
    if step_seconds is None:
        taken = sum(r.compute_steps for r in reports)
        step_seconds = sum(r.compute_seconds for r in reports) / taken if taken else 0.0
    cluster = get_cluster(cfg.cluster)
    out: dict[str, Any] = dict(project(records, cluster, steps, step_seconds))
    if plan.stragglers:
        slowest = sum(plan.slowdown_at(s, cfg.nodes) for s in range(steps))
        out["compute_seconds"] = slowest * step_seconds / cluster.speed
        out["total_seconds"] = (out["compute_seconds"] + out["communication_seconds"]
                                + out.get("sync_wait_seconds", 0.0))
        idle = sum(plan.idle_factor_at(s, cfg.nodes) for s in range(steps))
        out["idle_seconds"] = idle * step_seconds / cluster.speed
    out["step_seconds"] = step_seconds
    if measured_communication_seconds is not None:
        # What rank 0 spent inside its recorded collectives (waiting for peers included):
        # beside the projected communication, it shows where the model is off.
        out["measured_communication_seconds"] = measured_communication_seconds
    return out


def add_projected_seconds(history: list[dict[str, Any]], records: list[CommRecord], cluster: Cluster,
                           step_seconds: float, slowdowns: list[float] | None = None) -> None:
    """metrics.csv's ``projected_seconds``: the summary's projection, cumulative step by step
    (rank 0's collectives of each step plus its compute, times the step's straggler
    ``slowdowns``); the last row equals its total."""
    comm_seconds = [0.0] * len(history)
    backward = BACKWARD_SHARE * step_seconds / cluster.speed  # what DDP's buckets may hide behind
    for step, seconds in communication_by_step(records, cluster, backward, len(history)).items():
        # a collective after the last step (the final sync) counts in the last step
        comm_seconds[min(step, len(history) - 1)] += seconds
    for step, wait in sync_waits(records, cluster).items():  # 0 unless the cluster has a jitter
        comm_seconds[min(step, len(history) - 1)] += wait
    total = 0.0
    slowdowns = slowdowns or [1.0] * len(history)
    for row, seconds, slowdown in zip(history, comm_seconds, slowdowns, strict=True):
        total += step_seconds * slowdown / cluster.speed + seconds
        row["projected_seconds"] = total


def write_run(
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
        shares = {"balance": summary["balance"]} if "balance" in summary else {}
        run.write_config({**cfg.extra_config, "strategy": strategy.config(), "train": train,
                          "model": type(model).__name__, **shares, "provenance": provenance()})
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
