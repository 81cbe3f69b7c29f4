"""Optional loggers beside metrics.csv: Weights & Biases and TensorBoard.

metrics.csv and summary.json are always written; a run may also log to Weights & Biases
(the ``wandb`` setting, ``--wandb PROJECT``; ``pip install 'meshtrain[wandb]'``) and to
TensorBoard event files in ``<run>/tensorboard/`` (``--tensorboard``;
``pip install 'meshtrain[tensorboard]'``). Neither package is imported unless asked for.

Only rank 0 logs. It logs what the progress bar shows, when the bar is updated
(``train_loss``: the mean over nodes of the step's loss; ``total_bytes_sent``: bytes sent
per node since the first step), every validation (``val_loss``, ``node_val_loss``,
``val_<metric>``), the evaluation before training as step 0, then the last step's row of
metrics.csv and summary.json (whose ``wall_seconds`` is then taken a moment later, after the
run directory is written). Keys are metrics.csv's column names, steps its steps.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from meshtrain.errors import InputError

if TYPE_CHECKING:
    from meshtrain.config.settings import TrainConfig
    from meshtrain.engine.job import NodeJob
    from meshtrain.strategies import Strategy

#: For each logger setting: the module it imports and the extra that installs it.
PACKAGES = {"wandb": ("wandb", "wandb"), "tensorboard": ("tensorboard", "tensorboard")}
#: The metrics.csv columns a logger gets, besides every ``val_<metric>``.
ROW_KEYS = ("train_loss", "total_bytes_sent", "node_val_loss")


class MissingExtra(InputError):
    """A logger was asked for but its package is not installed (one line, exit 2)."""


class Logger(Protocol):
    """What a run logs to: scalars by step, then the summary once at the end."""

    def log(self, values: Mapping[str, float], step: int) -> None:
        """Record ``values`` (metrics.csv column names) at training step ``step``."""

    def finish(self, summary: Mapping[str, Any]) -> None:
        """Record the run's summary.json and close (the run succeeded)."""

    def abort(self) -> None:
        """Close after a failed or interrupted run."""


def wanted(config: TrainConfig) -> bool:
    """Whether ``config`` asks for any logger (every node must know: it adds collectives)."""
    return bool(config.wandb or config.tensorboard)


def require_installed(config: TrainConfig) -> None:
    """Raise :class:`MissingExtra` naming the extra to install for a logger asked for but
    missing, before anything trains."""
    for setting, (module, extra) in PACKAGES.items():
        if getattr(config, setting) and importlib.util.find_spec(module) is None:
            flag = f"--{setting}" + (f" {config.wandb}" if setting == "wandb" else "")
            raise MissingExtra(f"{flag}: the {module} package is not installed; "
                               f"pip install 'meshtrain[{extra}]'")


def _import(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(f"{module} does not import ({exc}); pip install 'meshtrain[{extra}]'") from None


def _plain(value: Any) -> Any:
    """A JSON-friendly copy (Path and other objects as text) for logger configs."""
    return json.loads(json.dumps(value, default=str))


class WandbLogger:
    """Logs to a Weights & Biases run named after the meshtrain run.

    Honours wandb's own environment: ``WANDB_MODE=offline`` logs locally (``wandb sync``
    uploads later), ``WANDB_DIR`` is where its files go (default ``./wandb``),
    ``WANDB_ENTITY`` the team.
    """

    def __init__(self, project: str, run_name: str, config: Mapping[str, Any]) -> None:
        wandb = _import("wandb", "wandb")
        # create_new: a second run in one process (Trainer.fit twice) gets its own W&B run.
        self.run = wandb.init(project=project, name=run_name, config=_plain(dict(config)),
                              reinit="create_new")

    def log(self, values: Mapping[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def finish(self, summary: Mapping[str, Any]) -> None:
        self.run.summary.update(_plain(dict(summary)))
        self.run.finish()

    def abort(self) -> None:
        self.run.finish(exit_code=1)


class TensorBoardLogger:
    """Writes TensorBoard event files (``tensorboard --logdir runs`` shows every run)."""

    def __init__(self, folder: Path, config: Mapping[str, Any]) -> None:
        _import("tensorboard", "tensorboard")  # torch's writer needs it; name the extra if missing
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder))
        self.writer.add_text("config", _as_code(config), 0)

    def log(self, values: Mapping[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def finish(self, summary: Mapping[str, Any]) -> None:
        self.writer.add_text("summary", _as_code(summary), int(summary.get("steps", 0)))
        self.writer.close()

    def abort(self) -> None:
        self.writer.close()


def _as_code(value: Mapping[str, Any]) -> str:
    """JSON indented as a Markdown code block (TensorBoard's text tab renders Markdown)."""
    text = json.dumps(_plain(dict(value)), indent=2)
    return "\n".join("    " + line for line in text.splitlines())


class RunLoggers:
    """The loggers a run's settings ask for, used as one (none: every call does nothing)."""

    def __init__(self, loggers: list[Logger] | None = None) -> None:
        self.loggers = loggers or []

    @classmethod
    def for_run(cls, job: NodeJob, strategy: Strategy, initial: Mapping[str, float]) -> RunLoggers:
        """Open the loggers ``job.config`` asks for (rank 0) and log the step-0 evaluation.

        TensorBoard writes into the reserved run directory, so its event files appear with
        the finished run (and vanish with a failed one, like every other file of it).
        """
        cfg = job.config
        if not wanted(cfg):
            return cls()
        train = {k: v for k, v in asdict(cfg).items() if k not in ("extra_config", "progress")}
        config = {**cfg.extra_config, "strategy": strategy.config(), "train": train, "run_id": job.run_id}
        loggers: list[Logger] = []
        try:
            if cfg.tensorboard:
                if job.run_dir is None:
                    raise ValueError("tensorboard: this rank writes no run directory")
                loggers.append(TensorBoardLogger(job.run_dir.partial / "tensorboard", config))
            if cfg.wandb:
                loggers.append(WandbLogger(cfg.wandb, job.run_id, config))
        except BaseException:
            cls(loggers).abort()
            raise
        opened = cls(loggers)
        if initial:
            opened.log({"node_val_loss": initial["val_loss"], **initial}, 0)  # metrics.csv's step-0 row
        return opened

    def log(self, values: Mapping[str, float | None], step: int) -> None:
        """Log the given values (``None``, as in an empty metrics.csv cell, is skipped)."""
        present = {k: float(v) for k, v in values.items() if v is not None}
        if present:
            for logger in self.loggers:
                logger.log(present, step)

    def finish(self, last_row: Mapping[str, Any], summary: Mapping[str, Any]) -> None:
        """Log the last metrics.csv row's losses, metrics and bytes, then the summary."""
        self.log({k: v for k, v in last_row.items() if k in ROW_KEYS or k.startswith("val_")},
                 int(last_row["step"]))
        for logger in self.loggers:
            logger.finish(summary)
        self.loggers = []

    def abort(self) -> None:
        """Close every logger after a failure; a failure to close is not the run's error."""
        for logger in self.loggers:
            try:
                logger.abort()
            except Exception:  # noqa: BLE001 - the run's own error is what gets reported
                pass
        self.loggers = []

    @contextmanager
    def closed_on_failure(self) -> Iterator[RunLoggers]:
        """Around training: if it raises (a node failed, Ctrl-C), close the loggers."""
        try:
            yield self
        except BaseException:
            self.abort()
            raise

