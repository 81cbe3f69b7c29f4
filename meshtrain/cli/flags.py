"""The training commands' options, generated from the settings' one definition.

Every :class:`~meshtrain.config.spec.RunSpec` field whose metadata carries a
:class:`~meshtrain.config.settings.Flag` becomes an option of each command the flag names,
with the setting's help, type and panel. :func:`takes_settings` gives a command function
those options: typer reads the function's ``__signature__``, and the function receives
the given values as ``**settings`` keyed by the settings' names (``None``: not given).
So adding a setting with a flag is one edit, in its definition.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar, Union

import typer
from rich.markup import escape

from meshtrain.cli.console import fail
from meshtrain.config.launching import LaunchSettings
from meshtrain.config.settings import CLUSTER, WHAT, Flag, Options, TrainConfig, from_flags
from meshtrain.config.spec import RunSpec
from meshtrain.errors import SettingError
from meshtrain.tasks import TASKS

Command = TypeVar("Command", bound=Callable[..., Any])

#: The layers that are not settings: a profile, and ``--set`` (kwargs ``profile``, ``set_``).
PROFILE_OPTION = typer.Option(None, "--profile", "-p", help="Profile name (profiles/NAME.yaml) or path.",
                              rich_help_panel=WHAT)
SET_OPTIONS = {
    "simulate": typer.Option([], "--set", help="Override any setting: key=value (H=50, steps=100, "
                                               "task_options.arch=cnn); values are read as YAML.",
                             rich_help_panel=WHAT),
    "compare": typer.Option([], "--set", help="KEY=VALUE for every run (lr=0.01, val_interval=25) or "
                                              "STRATEGY.KEY=VALUE for one (diloco.H=50).",
                            rich_help_panel=WHAT),
}
SET_OPTIONS["launch"] = SET_OPTIONS["simulate"]


def _steps_help(setting_help: str) -> str:
    """--steps help naming each task's suggested step count (the default a run gets)."""
    suggested = ", ".join(f"{entry.name} {entry.steps}" for entry in TASKS.values()
                          if entry.steps is not None)
    return (f"Training steps; each node takes one batch a step (default: the task's suggestion, "
            f"{suggested}; 100 for a task without one; none when epochs is given).")


#: A panel's name in a command where the setting's usual panel would mislead.
_PANEL_IN = {"launch": {CLUSTER: "Every rank"}}

#: Help that depends on what is installed, not on the setting alone.
_LIVE_HELP: dict[str, Callable[[str], str]] = {"steps": _steps_help}


def _fields(command: str) -> list[dataclasses.Field[Any]]:
    """The setting fields with a flag in ``command``: what to train (RunSpec's own) first,
    then the training settings, then the launcher's, each in definition order."""
    inherited = {f.name for f in dataclasses.fields(TrainConfig)}
    ordered = [*sorted(dataclasses.fields(RunSpec), key=lambda f: f.name in inherited),
               *dataclasses.fields(LaunchSettings)]
    return [f for f in ordered
            if f.metadata.get("flag") is not None and command in f.metadata["flag"].commands]


def setting_flags(command: str) -> dict[str, Flag]:
    """The settings ``command`` takes as flags, by setting name."""
    return {f.name: f.metadata["flag"] for f in _fields(command)}


def _option_type(annotation: Any) -> Any:
    """The type typer parses a flag as: the setting's type without None; a setting that
    takes one text or a list of them (``fail``) is a repeatable flag."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        lists = [a for a in kinds if typing.get_origin(a) is list]
        return lists[0] if lists else kinds[0]
    return annotation


def setting_parameters(command: str) -> list[inspect.Parameter]:
    """The typer parameters of ``command``'s settings and layers (profile, --set)."""
    hints = {**typing.get_type_hints(RunSpec), **typing.get_type_hints(LaunchSettings)}
    own = {f.name for f in dataclasses.fields(LaunchSettings)}
    params = [] if command == "compare" else [  # compare's runs differ only by strategy: no profile
        inspect.Parameter("profile", inspect.Parameter.KEYWORD_ONLY, default=PROFILE_OPTION, annotation=str)]
    for field in _fields(command):
        name, flag = field.name, field.metadata["flag"]
        text = flag.help_in(command, field.metadata.get("help", ""))
        text = _LIVE_HELP[name](text) if name in _LIVE_HELP and command not in dict(flag.help) else text
        # Escaped: typer renders help as rich markup, which would swallow "meshtrain[wandb]".
        # A launch's own settings have no layers below the flag: show their defaults.
        default = None if name not in own else \
            field.default_factory() if callable(field.default_factory) else field.default
        panel = flag.panel_in(command)
        option = typer.Option(default, *flag.names, help=escape(text), metavar=flag.metavar,
                              rich_help_panel=_PANEL_IN.get(command, {}).get(panel, panel))
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                        annotation=_option_type(hints[name])))
    return [*params, inspect.Parameter("set_", inspect.Parameter.KEYWORD_ONLY, default=SET_OPTIONS[command],
                                       annotation=list[str])]


def takes_settings(command: str) -> Callable[[Command], Command]:
    """Give a command function (``def f(own options..., **settings)``) the options of
    ``command``'s settings: its signature, as typer reads it, is its own parameters plus
    :func:`setting_parameters`."""
    def decorate(function: Command) -> Command:
        own = [p for p in inspect.signature(function).parameters.values()
               if p.kind is not inspect.Parameter.VAR_KEYWORD]
        hints = typing.get_type_hints(function)
        own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in own]
        generated = [p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
                     for p in setting_parameters(command)]
        function.__signature__ = inspect.Signature([*own, *generated])  # type: ignore[attr-defined]
        return function
    return decorate


def takes_options(cls: type, command: str) -> Callable[[Command], Command]:
    """Give a command function (``def f(arguments..., **options)``) an option for every field
    of dataclass ``cls`` whose flag names ``command``, with its help, default and panel;
    the function receives them by field name (read them with
    :func:`~meshtrain.config.settings.from_flags`)."""
    hints = typing.get_type_hints(cls)

    def decorate(function: Command) -> Command:
        own = [p for p in inspect.signature(function).parameters.values()
               if p.kind is not inspect.Parameter.VAR_KEYWORD]
        own_hints = typing.get_type_hints(function)
        own = [p.replace(annotation=own_hints.get(p.name, p.annotation)) for p in own]
        generated = []
        for field in dataclasses.fields(cls):
            flag = field.metadata.get("flag")
            if flag is None or command not in flag.commands:
                continue
            default = field.default_factory() if callable(field.default_factory) else field.default
            shown = flag.help_in(command, field.metadata["help"])
            option = typer.Option(default, *flag.names, help=escape(shown),
                                  metavar=flag.metavar, rich_help_panel=flag.panel_in(command))
            generated.append(inspect.Parameter(field.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                               default=option, annotation=_option_type(hints[field.name])))
        function.__signature__ = inspect.Signature([*own, *generated])  # type: ignore[attr-defined]
        return function
    return decorate


def checked_options(cls: type[Options], given: dict[str, Any]) -> Options:
    """The options a :func:`takes_options` command received, as its dataclass ``cls``, each
    checked by its own rule (bad input: one line naming the flag, exit 2)."""
    try:
        return from_flags(cls, given)
    except SettingError as exc:
        raise fail(str(exc)) from None
