"""A run described as data: the :class:`RunSpec`, profiles, and ``--set key=value``.

Layers, later ones win: RunSpec defaults < the task's suggested settings < a profile
(which may extend another with ``base:``) < command-line flags < ``--set``.
A run's config.yaml is itself a profile: ``meshtrain simulate --profile runs/ID/config.yaml``
repeats it.
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from meshtrain import yaml12
from meshtrain.config.settings import SettingError, TrainConfig, check_settings
from meshtrain.strategies import STRATEGIES, Optim, Strategy

#: Where ``--profile NAME`` looks: the working directory's profiles/ (your own), then the
#: built-in ones shipped inside the package (so an installed meshtrain has them too).
PROFILE_DIRS = [Path.cwd() / "profiles", Path(__file__).resolve().parent.parent / "profiles"]


class ConfigError(SettingError):
    """A bad profile, key or value: shown as one line naming it, exit 2."""


@dataclass
class RunSpec(TrainConfig):
    """Every setting of a run (the keys of a profile): what to train, with which strategy,
    plus every :class:`~meshtrain.config.settings.TrainConfig` setting."""

    description: str = field(default="", metadata={"help": "What this run is for (profiles)."})
    task: str = field(default="digits", metadata={"help": "What to train: `meshtrain tasks` lists "
                                                            "the tasks."})
    task_options: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "The task's own options (task_options.arch=cnn)."})
    data: str | None = field(default=None, metadata={"help": "Data file or folder the task reads."})
    strategy: str = field(default="diloco", metadata={"help": "Strategy: " + ", ".join(STRATEGIES)
                                                                + " (`meshtrain strategies`), or "
                                                                  "package.module:Class for your own."})
    strategy_options: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "The strategy's parameters (H=50 with --set)."})
    lr: float | None = field(default=None, metadata={
        "help": "Learning rate (DiLoCo: the inner optimizer's).", "above": 0})

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name not in NOT_IN_PROFILES]

    def to_dict(self) -> dict[str, Any]:
        """The spec as a profile (what config.yaml records; replaying it repeats the run)."""
        out = {k: v for k, v in asdict(self).items() if k not in NOT_IN_PROFILES}
        if self.data is not None:
            out["data"] = str(Path(self.data).expanduser().resolve())
        return out

    def train_config(self, **extra: Any) -> TrainConfig:
        """The training settings of this spec, as ``Trainer.fit`` takes them."""
        names = {f.name for f in fields(TrainConfig)}
        return TrainConfig(**{k: getattr(self, k) for k in names if k != "extra_config"}, **extra)


#: Settings a run records elsewhere or never repeats: a replay gets a new run id.
NOT_IN_PROFILES = ("extra_config", "run_id", "progress", "resume")


#: Settings a resumed run may change: how far it goes (steps upward), where and how it
#: logs, how it runs here. Any other change would continue a different run from this
#: one's state (another strategy's optimizer, another task's weights) and is refused.
RESUMABLE = ("steps", "epochs", "description", "data", "nodes", "device", "runtime", "threads",
             "val_interval", "val_size", "out_dir", "progress", "timeout_s", "cluster",
             "step_seconds", "checkpoint_every", "keep_checkpoints", "check_sync",
             "skip_nonfinite", "wandb", "tensorboard", "fail", "straggler", "precision",
             "gradient_checkpointing")


def resume_conflict(saved: dict[str, Any], spec: RunSpec, step: int) -> str | None:
    """Why ``spec`` cannot continue the run whose settings were ``saved`` from its
    checkpoint after ``step`` steps, or None. ``nodes`` is checked by the trainer (fewer
    is allowed for some strategies) and ``data`` is a path (its contents are not known)."""
    now = spec.to_dict()
    for key in RunSpec.field_names():
        if key in RESUMABLE or key not in saved:
            continue
        if _comparable(saved[key]) != _comparable(now.get(key)):
            return (f"{key} was {saved[key]!r} in the checkpointed run, now {now.get(key)!r}; a "
                    f"resumed run keeps its settings (it may change: steps upward, logging, threads, "
                    "device and other settings of how it runs)")
    # steps equal to the checkpoint's writes its global model without a further step.
    if spec.steps is not None and spec.steps < step:
        return (f"the checkpoint is at step {step}, past steps {spec.steps}; give --steps of "
                f"at least {step}")
    return None


def _comparable(value: Any) -> Any:
    """Numbers compare by value (1 and 1.0, 1e-3 and 0.001); containers element-wise."""
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_comparable(v) for v in value]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return value


def find_profile(name: str) -> Path:
    """A profile by name (``profiles/NAME.yaml``) or by path."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if path.is_dir():
            raise ConfigError(f"profile {name} is a folder, not a profile file (NAME.yaml)")
        if not path.is_file():
            raise ConfigError(f"profile file {name} does not exist")
        return path
    for folder in PROFILE_DIRS:
        candidate = folder / f"{name}.yaml"
        if candidate.is_file():
            return candidate
    raise ConfigError(f"no profile named {name!r}; `meshtrain profiles` lists them")


def list_profiles() -> dict[str, Path]:
    """Every profile found, by name (the working directory's profiles/ first)."""
    found: dict[str, Path] = {}
    for folder in PROFILE_DIRS:
        for path in sorted(folder.glob("*.yaml")):
            found.setdefault(path.stem, path)
    return found


def load_profile(name: str, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """A profile's settings with its ``base:`` chain merged in (nested dicts merge)."""
    path = find_profile(name)
    key = str(path.resolve())
    if key in _seen:
        raise ConfigError(f"profile {path}: 'base' chain loops back to itself")
    try:
        raw = yaml12.load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"profile {path}: not UTF-8 text (a binary file?); a profile is a "
                          "YAML file of settings") from None
    except OSError as exc:
        raise ConfigError(f"profile {path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"profile {path}: not valid YAML ({exc.__class__.__name__})") from exc
    if raw is None:
        raise ConfigError(f"profile {path}: the file is empty; give settings as key: value lines "
                          "(`meshtrain settings` lists them)")
    if not isinstance(raw, dict):
        raise ConfigError(f"profile {path}: expected a mapping of settings")
    raw = _strip_run_record(raw)
    base = raw.pop("base", None)
    unknown = sorted(set(raw) - set(RunSpec.field_names()))
    if unknown:
        raise ConfigError(f"profile {path}: unknown key {unknown[0]!r}")
    check_settings(RunSpec, raw, f"profile {path}: ")
    if base is None:
        return raw
    return merge(load_profile(str(base), _seen + (key,)), raw)


def _strip_run_record(raw: dict[str, Any]) -> dict[str, Any]:
    """A run's config.yaml also records what the run resolved; keep only the spec."""
    if "train" in raw and isinstance(raw.get("spec"), dict):
        return {k: v for k, v in raw["spec"].items() if k not in NOT_IN_PROFILES}
    return raw


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
            if path[0] in STRATEGIES and len(path) > 1:
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
    strategy_class(spec.strategy)
    return spec


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
