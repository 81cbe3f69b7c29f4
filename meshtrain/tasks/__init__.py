"""Built-in tasks: a model plus its data, by name (`meshtrain tasks` lists them).

A task module exposes ``TASK = Task(...)``. The registry names the module instead of
importing it, so listing tasks never imports transformers.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshtrain.config.settings import check_value
from meshtrain.errors import InputError, SettingError
from meshtrain.progress import Status

if TYPE_CHECKING:  # the registry loads without torch (the commands' help names the tasks)
    from torch import nn
    from torch.utils.data import Dataset

    from meshtrain.data import Collate, DataFactory


class TaskError(InputError):
    """Bad task input (missing data file, unknown option): shown as one line, exit 2."""


@dataclass
class TaskOptions:
    """What a task is built from: ``--data``, the run seed, and its own options; ``status``
    announces the slow phases of building (loading a model, checking data)."""

    data: str | None = None
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    status: Status = field(default_factory=Status)


@dataclass
class TaskBundle:
    """A built task: what :class:`meshtrain.Trainer` takes."""

    model: nn.Module
    train_data: Dataset[Any] | DataFactory
    val_data: Dataset[Any] | DataFactory | None = None
    collate_fn: Collate | None = None


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    build: Callable[[TaskOptions], TaskBundle]
    #: Suggested run settings (RunSpec fields such as steps, batch_size, val_interval).
    defaults: dict[str, Any] = field(default_factory=dict)
    #: Suggested strategy options, by strategy name (e.g. {"diloco": {"H": 25}}).
    strategy_defaults: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Options this task understands, with their defaults (for `meshtrain tasks`).
    options: dict[str, Any] = field(default_factory=dict)
    #: Whether the task reads ``--data`` (a file or folder).
    takes_data: bool = True
    #: Checks ``--data`` (a local path) with the task's options as :meth:`build` would,
    #: without building: ``launch`` refuses here what every host would refuse after shipping.
    check_data: Callable[[Path, dict[str, Any]], None] | None = None


@dataclass(frozen=True)
class TaskEntry:
    name: str
    description: str
    module: str
    #: The task's suggested ``steps`` (its Task.defaults'), for the --steps help, which every
    #: command builds without importing the task (tests/test_cli_imports.py checks they agree).
    steps: int | None = None


TASKS: dict[str, TaskEntry] = {
    e.name: e
    for e in (
        TaskEntry("digits", "scikit-learn's 8x8 handwritten digits (1797 images), MLP or CNN",
                  "meshtrain.tasks.digits", steps=300),
        TaskEntry("gpt", "character-level GPT on a text file given by --data",
                  "meshtrain.tasks.gpt", steps=200),
        TaskEntry("whisper", "fine-tune a Hugging Face Whisper model on a folder of recordings",
                  "meshtrain.tasks.whisper", steps=200),
    )
}


def get_task(name: str) -> Task:
    """The task called ``name``; :class:`TaskError` naming the choices if there is none."""
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")
    return importlib.import_module(TASKS[name].module).TASK


def check_options(task: Task, options: dict[str, Any]) -> dict[str, Any]:
    """The task's option defaults overlaid with ``options``.

    Unknown names are errors, and so is a value whose type differs from the default's
    (a whole number where the default is one, a number where it is a float, ...); a
    task checks ranges itself when it builds.
    """
    unknown = sorted(set(options) - set(task.options))
    if unknown:
        known = ", ".join(task.options) or "none"
        raise TaskError(f"task {task.name!r} has no option {unknown[0]!r} (options: {known})")
    for name, value in options.items():
        default = task.options[name]
        if default is None or value is None:
            continue
        annotation = float if isinstance(default, float) else type(default)
        try:
            check_value(f"task_options.{name}", value, annotation)
        except SettingError as exc:
            raise TaskError(f"task {task.name!r}: {exc}") from None
    return {**task.options, **options}


def require_positive(task: str, options: dict[str, Any], *names: str) -> None:
    """Raise :class:`TaskError` unless each named option is >= 1."""
    for name in names:
        if options[name] < 1:
            raise TaskError(f"task {task!r}: task_options.{name} must be >= 1, got {options[name]!r}")
