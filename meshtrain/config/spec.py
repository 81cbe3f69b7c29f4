"""A run described as data: :class:`RunSpec`, every setting of a run (the keys of a
profile), and the settings file that carries a resolved spec to a launched rank.

The rest of a run's configuration has a module each: :mod:`~meshtrain.config.profiles`
(profiles and their ``base:`` chains), :mod:`~meshtrain.config.layers` (``--set`` and how
layers combine), :mod:`~meshtrain.config.strategy_options` (a strategy from its name and
options) and :mod:`~meshtrain.config.resume` (what a resumed run may change).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from meshtrain import yaml12
from meshtrain.config.settings import ALL, BOTH, KEEP, MAY_CHANGE, WHAT, Flag, TrainConfig
from meshtrain.errors import SettingError

#: The built-in strategies' names, as meshtrain.strategies.STRATEGIES lists them: named here
#: so that the --strategy help, built with every command, needs no strategy (and no torch)
#: loaded; tests/test_cli_imports.py checks the two agree.
BUILT_IN_STRATEGIES = ("ddp", "diloco", "sparta", "sparta-diloco", "fedavg", "demo", "sparseloco",
                       "streaming-diloco", "async-diloco")


class ConfigError(SettingError):
    """A bad profile, key or value: shown as one line naming it, exit 2."""


@dataclass
class RunSpec(TrainConfig):
    """Every setting of a run (the keys of a profile): what to train, with which strategy,
    plus every :class:`~meshtrain.config.settings.TrainConfig` setting."""

    description: str = field(default="", metadata={"help": "What this run is for (profiles).",
                                                    "may_be_empty": True,
                                                    "on_resume": MAY_CHANGE})
    task: str = field(default="digits", metadata={
        "help": "What to train: `meshtrain tasks` lists the tasks.",
        "flag": Flag(("--task", "-t"), WHAT, ALL), "on_resume": KEEP})
    task_options: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "The task's own options (task_options.arch=cnn).", "on_resume": KEEP})
    data: str | None = field(default=None, metadata={"help": "Data file or folder the task reads.",
                                                      "flag": Flag(("--data",), WHAT, ALL),
                                                      # a path: the file may have moved
                                                      "on_resume": MAY_CHANGE})
    strategy: str = field(default="diloco", metadata={
        "help": "Strategy: " + ", ".join(BUILT_IN_STRATEGIES) + " (`meshtrain strategies`), or "
                "package.module:Class for your own.",
        "flag": Flag(("--strategy", "-s"), WHAT, BOTH), "on_resume": KEEP})
    strategy_options: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "The strategy's parameters (H=50 with --set).", "on_resume": KEEP})
    lr: float | None = field(default=None, metadata={
        "help": "Learning rate (DiLoCo: the inner optimizer's).", "above": 0,
        "flag": Flag(("--lr",), WHAT, ALL), "on_resume": KEEP})

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


def settings_file_text(spec: RunSpec, comment: str) -> str:
    """A resolved spec as a settings file (YAML): what a launched rank trains with. Unlike
    :meth:`RunSpec.to_dict` it keeps ``data`` as given (a path on the hosts) and
    ``progress``; a run's id and resume point are given per launch."""
    values = {k: v for k, v in asdict(spec).items() if k not in ("extra_config", "run_id", "resume")}
    return f"# {comment}\n" + yaml.safe_dump(values, sort_keys=False)


def load_settings_file(path: str) -> dict[str, Any]:
    """The settings of a file :func:`settings_file_text` wrote; :class:`ConfigError` names it."""
    try:
        raw = yaml12.read(Path(path))
    except OSError as exc:
        raise ConfigError(f"settings file {path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"settings file {path}: {yaml12.problem(exc)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"settings file {path}: expected a mapping of settings")
    return raw
