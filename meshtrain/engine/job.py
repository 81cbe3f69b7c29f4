"""A run handed to a runtime, and what comes back: the types that the Trainer, the
runtimes and the node loop share (so none of them imports another to get them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from meshtrain import checkpoint
from meshtrain.config.settings import TrainConfig
from meshtrain.data import Collate, DataFactory
from meshtrain.errors import RunFailure
from meshtrain.run_dir import RunDirectory
from meshtrain.strategies import Strategy


@dataclass
class NodeJob:
    """What every node needs to train (picklable for the processes runtime)."""

    model: nn.Module
    train_data: Dataset[Any] | DataFactory
    val_data: Dataset[Any] | DataFactory | None
    collate_fn: Collate | None
    strategy: Strategy
    config: TrainConfig
    run_id: str
    started: float
    run_dir: RunDirectory | None = None  # reserved before the first step (where rank 0 writes)
    checkpoints: Path | None = None  # where checkpoints go (checkpoint_every set)
    resume: checkpoint.Found | None = None  # the checkpoint this run continues from
    began: float | None = None  # when the work for the run began (the progress bar's clock)


@dataclass
class FitResult:
    """What :meth:`Trainer.fit` returns."""

    model: nn.Module  # the global model
    history: list[dict[str, Any]]  # one record per step (rank 0; empty on other launched ranks)
    run_dir: Path | None  # where config, metrics and the model were written (rank 0)
    summary: dict[str, Any]


class NodeFailed(RunFailure):
    """A node raised: the run stopped, and this names the node and its error.

    ``str()`` is one line; ``traceback`` holds the failing node's full traceback (shown by
    ``--verbose`` and written to ``<out>/<run-id>.error.log``).
    """

    def __init__(self, rank: int, message: str, traceback: str = "") -> None:
        super().__init__(f"node {rank} failed: {message}")
        self.rank = rank
        self.message = message
        self.traceback = traceback
