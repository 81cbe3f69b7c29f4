"""Options that several commands share, each with its help taken from the setting's one
definition (:class:`~meshtrain.config.spec.RunSpec`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import typer
from rich.markup import escape

from meshtrain.config.settings import help_for
from meshtrain.config.spec import RunSpec
from meshtrain.tasks import TASKS, get_task


def flag(name: str, *flags: str, **kwargs: Any) -> Any:
    """A CLI option for setting ``name``, its help taken from the setting's one definition
    (escaped: typer renders help as rich markup, which would swallow "meshtrain[wandb]")."""
    spec_fields = {f.name: f for f in dataclasses.fields(RunSpec)}
    kwargs.setdefault("help", escape(spec_fields[name].metadata.get("help", "")))
    return typer.Option(None, *flags, **kwargs)


def _steps_help() -> str:
    """--steps help naming each task's suggested step count (the default a run gets)."""
    suggested = ", ".join(f"{entry.name} {get_task(entry.name).defaults['steps']}"
                          for entry in TASKS.values() if "steps" in get_task(entry.name).defaults)
    return (f"Training steps; each node takes one batch a step (default: the task's suggestion, "
            f"{suggested}; 100 for a task without one; none when epochs is given).")


# Flags shared by `simulate` and `launch` (the launcher forwards them to every rank).
TRAINING_FLAGS = dict(
    profile=typer.Option(None, "--profile", "-p", help="Profile name (profiles/NAME.yaml) or path.",
                         rich_help_panel="What to train"),
    strategy=flag("strategy", "--strategy", "-s", rich_help_panel="What to train"),
    task=flag("task", "--task", "-t", rich_help_panel="What to train"),
    data=flag("data", "--data", rich_help_panel="What to train"),
    steps=flag("steps", "--steps", help=_steps_help(), rich_help_panel="What to train"),
    epochs=flag("epochs", "--epochs", rich_help_panel="What to train"),
    batch_size=flag("batch_size", "--batch-size", "-b", rich_help_panel="What to train"),
    microbatch_size=flag("microbatch_size", "--microbatch-size", rich_help_panel="What to train"),
    lr=flag("lr", "--lr", rich_help_panel="What to train"),
    device=flag("device", "--device", rich_help_panel="The simulated cluster"),
    seed=flag("seed", "--seed", rich_help_panel="What to train"),
    threads=flag("threads", "--threads", rich_help_panel="The simulated cluster"),
    val_interval=flag("val_interval", "--val-interval", rich_help_panel="Output"),
    wandb=flag("wandb", "--wandb", metavar="PROJECT", rich_help_panel="Output"),
    tensorboard=typer.Option(None, "--tensorboard/--no-tensorboard", help=escape(help_for("tensorboard")),
                             rich_help_panel="Output"),
    balance=typer.Option(None, "--balance/--no-balance", help=escape(help_for("balance")),
                         rich_help_panel="What to train"),
    set_=typer.Option([], "--set", help="Override any setting: key=value (H=50, steps=100, "
                                        "task_options.arch=cnn); values are read as YAML.",
                      rich_help_panel="What to train"),
)
