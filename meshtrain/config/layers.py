"""How the layers of a run's settings combine, and ``--set key=value``.

Layers, later ones win: RunSpec defaults < the task's suggested settings < a profile
(which may extend another with ``base:``) < command-line flags < ``--set``. The one
resolver that puts them together for a command is :func:`meshtrain.build.resolve_run`.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from meshtrain import yaml12
from meshtrain.config.settings import check_settings
from meshtrain.config.spec import BUILT_IN_STRATEGIES, ConfigError, RunSpec


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``, merging nested dicts."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_set(items: list[str], strategy_name: str) -> dict[str, Any]:
    """``--set key=value`` items as a nested override dict.

    ``key`` is a RunSpec field (``steps=100``), a dotted path (``task_options.lora.r=16``),
    or a bare parameter of the strategy (``H=50`` means ``strategy_options.H=50``).
    Values are read as YAML: ``1e-3`` is a float, ``true`` a bool, ``[a, b]`` a list.
    """
    from meshtrain.config.strategy_options import strategy_class  # loads torch: see resolve_spec

    out: dict[str, Any] = {}
    strategy_params = set(strategy_class(strategy_name).parameters())
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key=value")
        if not text.strip():
            raise ConfigError(f"--set {key}=: empty value; give {key}=VALUE")
        try:
            value = yaml12.load(text)
        except yaml.YAMLError:
            value = text
        path = key.split(".")
        if path[0] not in RunSpec.field_names():
            if path[0] in BUILT_IN_STRATEGIES and len(path) > 1:
                raise ConfigError(
                    f"--set {key}: the STRATEGY.KEY form belongs to `meshtrain compare`; for this "
                    f"run give --strategy {path[0]} --set {'.'.join(path[1:])}={text.strip()}")
            if path[0] in strategy_params:
                path = ["strategy_options", *path]
            else:
                raise ConfigError(
                    f"--set {key}: not a setting or a parameter of strategy {strategy_name!r} "
                    f"(its parameters: {', '.join(sorted(strategy_params))})"
                )
        elif len(path) > 1 and path[0] not in ("task_options", "strategy_options"):
            raise ConfigError(f"--set {key}: {path[0]!r} has no sub-keys")
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def resolve_spec(layers: list[tuple[str, dict[str, Any]]]) -> RunSpec:
    """Merge labelled settings layers (earliest first) into a checked :class:`RunSpec`.

    Each layer is ``(where, settings)``; ``where`` names it in errors (``"--set "``).
    ``None`` means "not given". ``steps`` and ``epochs`` exclude each other: a layer that
    gives one clears the other from the layers below it.
    """
    merged: dict[str, Any] = {}
    for where, layer in layers:
        given = {k: v for k, v in layer.items() if v is not None}
        check_settings(RunSpec, given, where)
        if "steps" in given and "epochs" in given:
            raise ConfigError(f"{where or 'flags: '}give steps or epochs, not both")
        for exclusive, other in (("steps", "epochs"), ("epochs", "steps")):
            if exclusive in given:
                merged.pop(other, None)
        merged = merge(merged, given)
    spec = RunSpec(**merged)
    spec.validate()
    # Here, not at the top: the strategies load torch, which the commands that only read
    # settings (their --help, hosts, clusters) never need.
    from meshtrain.config.strategy_options import strategy_class

    strategy_class(spec.strategy)
    return spec
