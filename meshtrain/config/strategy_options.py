"""A strategy from its name (built in, or ``package.module:Class``) and its options."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from meshtrain.config.settings import MAX_INT, MIN_INT
from meshtrain.config.spec import ConfigError, RunSpec
from meshtrain.strategies import STRATEGIES, Optim, Strategy


def strategy_class(name: str) -> type[Strategy]:
    """A built-in strategy by name, or your own as ``package.module:Class``."""
    if ":" in name:
        return custom_strategy_class(name)
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)} "
                          "(or package.module:Class for your own)")
    return STRATEGIES[name]


def custom_strategy_class(path: str) -> type[Strategy]:
    """The :class:`Strategy` subclass ``package.module:Class`` names; :class:`ConfigError`, one
    line, if it cannot be imported or is not a strategy. As with ``python -m``, modules in
    the working directory can be imported (examples.custom_strategy:Int8DDP)."""
    module_name, _, class_name = path.partition(":")
    where = f"strategy {path!r}"
    if not all(part.isidentifier() for part in module_name.split(".")) or not class_name.isidentifier():
        raise ConfigError(f"{where}: expected package.module:Class")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # searched last: it never shadows an installed package
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise ConfigError(f"{where}: no module named {exc.name!r} here or among the installed "
                              "packages") from None
        raise ConfigError(f"{where}: importing {module_name} failed: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed: say so in one line
        raise ConfigError(f"{where}: importing {module_name} failed: {type(exc).__name__}: {exc}") \
            from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(f"{where}: module {module_name} has no {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ConfigError(f"{where}: {class_name} is not a subclass of meshtrain.strategies.Strategy")
    return cls


def _check_type(strategy: str, key: str, value: Any, default: Any) -> None:
    """Reject a value whose type cannot be what the parameter's default suggests."""
    if default is None or value is None or key == "optim":
        return
    expected: tuple[type, ...]
    if isinstance(default, bool):
        expected = (bool,)
    elif isinstance(default, int):
        expected = (int,)
    elif isinstance(default, float):
        expected = (int, float)
    else:
        expected = (type(default),)
    if not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected):
        kind = " or ".join(t.__name__ for t in expected)
        raise ConfigError(f"strategy {strategy!r}: {key} must be {kind}, got {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and not MIN_INT <= value <= MAX_INT:
        raise ConfigError(f"strategy {strategy!r}: {key} must be between {MIN_INT} and {MAX_INT}, "
                          f"got {value!r}")


def build_strategy(spec: RunSpec) -> Strategy:
    """The strategy a spec names, with its options (and ``lr`` if set); errors name the key."""
    cls = strategy_class(spec.strategy)
    options = dict(spec.strategy_options)
    if spec.lr is not None:
        options["lr"] = spec.lr
    params = cls.parameters()
    for key in options:
        if key not in params:
            raise ConfigError(
                f"strategy {spec.strategy!r} has no parameter {key!r} "
                f"(its parameters: {', '.join(params)})"
            )
    for key, value in options.items():
        _check_type(spec.strategy, key, value, params[key].default)
    optim = options.get("optim")
    if isinstance(optim, dict):
        optim = dict(optim)
        if "name" not in optim:
            raise ConfigError("strategy_options.optim needs a 'name' (sgd, adam or adamw)")
        options["optim"] = Optim(optim.pop("name"), **optim)
    try:
        return cls(**options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"strategy {spec.strategy!r}: {exc}") from exc
