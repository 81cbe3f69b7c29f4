"""The Trainer: the API that checks a run's settings and hands it to a runtime.

    trainer = Trainer(model, train_data, val_data)
    result = trainer.fit(strategy=DiLoCo(H=50), nodes=4, max_steps=200)

``fit`` hands a :class:`~meshtrain.engine.job.NodeJob` to a runtime (threads, processes, or the
rank this process already is under ``meshtrain launch``/torchrun). Each node runs
:func:`meshtrain.engine.loop.train_node`; rank 0 collects the nodes' reports and writes the run
directory.
"""

from __future__ import annotations

import os
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import yaml
from torch import nn
from torch.utils.data import Dataset

from meshtrain import checkpoint
from meshtrain.allocator import limit_malloc_arenas
from meshtrain.config.environment import (
    environment_run_id,
    launched_rank,
    resolve_threads,
    writes_run_directory,
)
from meshtrain.config.resume import fit_conflict
from meshtrain.config.settings import TrainConfig, check_run_id
from meshtrain.data import Collate, DataFactory
from meshtrain.devices import check_gpus_for_processes, resolve_device
from meshtrain.engine import balance, loggers, memory, runtimes
from meshtrain.engine.job import FitResult, NodeJob
from meshtrain.engine.runtimes.vmap import vmap_refusal
from meshtrain.errors import InputError, SettingError
from meshtrain.run_dir import RunDirectory
from meshtrain.strategies import DiLoCo, Strategy


class Trainer:
    """Trains a model on N nodes with a communication strategy.

    Args:
        model: ``model(batch)`` returns a scalar loss. Optional hooks:
            ``validation_metrics(batches) -> dict[str, float]`` (e.g. accuracy, WER),
            evaluated on the global model; ``save_pretrained(dir)`` for saving.
        train_data: a Dataset (sharded across nodes, seeded shuffle each epoch) or a
            factory ``f(rank, nodes, split)`` returning each node's Dataset, used as-is.
        val_data: the same kinds, for validation (never sharded).
        collate_fn: turns a list of samples into a batch (default: torch's default_collate).
    """

    def __init__(
        self,
        model: nn.Module,
        train_data: Dataset[Any] | DataFactory,
        val_data: Dataset[Any] | DataFactory | None = None,
        collate_fn: Collate | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.train_data = train_data
        self.val_data = val_data
        self.collate_fn = collate_fn

    def fit(
        self,
        strategy: Strategy | None = None,
        nodes: int | None = None,
        max_steps: int | None = None,
        batch_size: int | None = None,
        *,
        config: TrainConfig | None = None,
        **settings: Any,
    ) -> FitResult:
        """Train and return the global model, per-step history and the run directory.

        Settings are those of :class:`~meshtrain.config.settings.TrainConfig` (``meshtrain
        settings`` lists them with their defaults), given as a ``config``, as keywords
        (``epochs=2, runtime="processes", cluster="wifi"``), or both (keywords win);
        ``max_steps`` is the ``steps`` setting. Everything is checked, and the run
        directory reserved, before any node starts: see :meth:`prepare`.

        ``threads`` is torch's intra-op thread count per node. Default: the
        MESHTRAIN_THREADS environment variable if set, else on a launched rank its
        machine's cores shared among the ranks started there (LOCAL_WORLD_SIZE), and 1
        per node locally (simulated nodes share this machine's cores).
        Results are bit-identical across runtimes only at the same thread count.

        Inside a launched rank (RANK and WORLD_SIZE set, as by ``meshtrain launch`` or
        torchrun) this process joins the group as that rank instead of spawning nodes.

        On a GPU the model is moved there (``self.model.to(device)``) before the nodes copy
        it, so its frozen weights are there once for every node; it is never trained in place.
        """
        # Before any node thread allocates: the nodes then share one malloc arena (glibc).
        limit_malloc_arenas()
        job = self.prepare(strategy, nodes, max_steps, batch_size, config=config, **settings)
        return run_job(job)

    def prepare(
        self,
        strategy: Strategy | None = None,
        nodes: int | None = None,
        max_steps: int | None = None,
        batch_size: int | None = None,
        *,
        config: TrainConfig | None = None,
        began: float | None = None,
        **settings: Any,
    ) -> NodeJob:
        """Check every setting and reserve the run directory; the job :func:`run_job` runs.

        ``began`` is when the work for this run began (``time.time()``, e.g. before the
        model was loaded): the progress bar's clock counts from there (default: now).

        Raises ``ValueError`` (bad settings, a batch larger than a shard, a taken run id,
        an unwritable output folder) before anything has trained.
        """
        given = {"nodes": nodes, "steps": max_steps, "batch_size": batch_size}
        settings.update({k: v for k, v in given.items() if v is not None})
        unknown = sorted(set(settings) - {f.name for f in fields(TrainConfig)})
        if unknown:
            raise TypeError(f"fit() got an unexpected setting {unknown[0]!r}")
        if isinstance(settings.get("out_dir"), os.PathLike):
            settings["out_dir"] = os.fspath(settings["out_dir"])
        config = replace(config or TrainConfig(), **settings)
        strategy = strategy if strategy is not None else DiLoCo()
        launched = launched_rank()
        if launched is not None:
            world = launched.world_size
            if nodes is not None and nodes != world:
                raise ValueError(f"nodes={nodes} but this launched run has WORLD_SIZE={world}")
            config = replace(config, nodes=world, runtime="launched")
        if config.steps is None and config.epochs is None:
            config = replace(config, steps=100)
        config = replace(config, threads=resolve_threads(config.threads, config.runtime))
        config.validate()
        strategy.check_nodes(config.nodes)
        if config.runtime != "launched":  # --straggler and a strategy's own speeds, before any node starts
            stragglers = config.fault_plan().stragglers
            strategy.check_speeds([1.0 / stragglers.get(r, 1.0) for r in range(config.nodes)])
        balance.check_strategy(strategy, config.balance)
        device = resolve_device(config.device)
        check_gpus_for_processes(config.runtime, config.nodes, device)
        if config.runtime == "vmap":
            refusal = vmap_refusal(strategy, config, self.model, self.train_data, self.collate_fn)
            if refusal:
                raise InputError(f"runtime vmap: {refusal}")
        memory.check_precision(config.precision, device)
        if config.gradient_checkpointing:
            memory.require_checkpointing(self.model)
        _check_batch_fits_a_shard(self.train_data, config)
        resume = _checkpoint_to_resume(config, strategy)
        if resume is not None:
            checkpoint.check_base(resume, self.model)
        interval = strategy.sync_interval()
        if config.checkpoint_every and interval:
            # Checkpoint right after an outer sync (DiLoCo, FedAvg): round up to a multiple of H.
            config = replace(config, checkpoint_every=-(-config.checkpoint_every // interval) * interval)
        writes = writes_run_directory()
        if writes:
            loggers.require_installed(config)  # a missing wandb/tensorboard: one line, nothing trains
        run_id = config.run_id or (resume.run_id if resume else None) or environment_run_id()
        if run_id is not None:  # from a checkpoint or the environment: a folder name, checked like --run-id
            check_run_id(run_id)
        run_dir = RunDirectory.reserve(Path(config.out_dir), run_id, strategy.name, config.nodes) \
            if writes else None
        run_id = run_dir.run_id if run_dir else (run_id or "rank")
        return NodeJob(model=self.model, train_data=self.train_data, val_data=self.val_data,
                       collate_fn=self.collate_fn, strategy=strategy, config=config, run_id=run_id,
                       started=time.time(), began=began, run_dir=run_dir,
                       checkpoints=_checkpoint_folder(config, run_id, resume, writes), resume=resume)


def _check_batch_fits_a_shard(train_data: Any, config: TrainConfig) -> None:
    """A batch must fit in each node's shard of a sized dataset (one line naming the fix)."""
    if not isinstance(train_data, Dataset):
        return
    size = len(train_data)  # type: ignore[arg-type]
    shard = size // config.nodes
    if config.batch_size > shard:
        held = f"{shard} sample{'' if shard == 1 else 's'} of {size} over {config.nodes} nodes"
        fix = (f"use a batch size of at most {shard}, fewer nodes or more data" if shard
               else f"use at most {size} nodes or more data")
        raise ValueError(f"batch size {config.batch_size} is larger than the shard of each node "
                         f"({held}); {fix}")


def _checkpoint_to_resume(config: TrainConfig, strategy: Strategy) -> checkpoint.Found | None:
    """The checkpoint ``config.resume`` names, if this run can continue from it."""
    resume = checkpoint.find_latest(config.resume) if config.resume else None
    if resume is not None and resume.nodes < config.nodes:
        raise ValueError(f"--resume {config.resume}: the checkpoint has {resume.nodes} nodes, "
                         f"this run {config.nodes} (a run can continue on fewer nodes, not more)")
    if resume is not None and resume.nodes > config.nodes:
        refusal = checkpoint.fewer_nodes_refusal(strategy)
        if refusal:
            raise ValueError(f"--resume {config.resume} on {config.nodes} of its {resume.nodes} "
                             f"nodes: {refusal}")
    if resume is not None:  # each setting's definition says whether it may change (config/resume.py)
        conflict = fit_conflict(resume.settings, config, strategy, resume.step)
        if conflict:
            raise SettingError(f"--resume {config.resume}: {conflict}")
    return resume


def _checkpoint_folder(config: TrainConfig, run_id: str, resume: checkpoint.Found | None,
                       writes: bool) -> Path | None:
    """Where this run's checkpoints go (created), or None without ``checkpoint_every``."""
    if not config.checkpoint_every:
        return None
    checkpoints = checkpoint.checkpoint_folder(config.out_dir, run_id)
    checkpoints.mkdir(parents=True, exist_ok=True)
    if resume is not None and resume.folder.parent.resolve() != checkpoints.resolve():
        # Another run's checkpoints (or a finished run's): this run starts a folder of its
        # own from a copy of the one it continues, and leaves theirs where they are, so the
        # run it came from can still be resumed (a finished run moves its folder into its
        # run directory).
        checkpoint.copy_checkpoint(resume, checkpoints)
    # Every launched host keeps its own checkpoints, so each needs the settings too.
    if (writes or config.runtime == "launched") and "spec" in config.extra_config:
        checkpoint.write_synced(checkpoints / checkpoint.SPEC, lambda f: f.write(
            yaml.safe_dump(config.extra_config["spec"], sort_keys=False).encode()))
    return checkpoints


def run_job(job: NodeJob) -> FitResult:
    """Train a prepared job on its runtime. On failure the reserved run directory is
    removed and the error, with every node's traceback, goes to ``<out>/<run-id>.error.log``;
    a run stopped by Ctrl-C leaves no log (nothing went wrong)."""
    try:
        return runtimes.run(job)
    except BaseException as exc:
        if job.run_dir is not None:
            job.run_dir.discard()
            if not isinstance(exc, KeyboardInterrupt):
                job.run_dir.write_error_log(exc)
        raise
    finally:
        if job.run_dir is not None:
            job.run_dir.release()  # where node processes committed it, the claim is still ours
