"""Profiles: ready-made runs as YAML files of settings, which may extend another (``base:``).

A run's config.yaml is itself a profile: ``meshtrain simulate --profile runs/ID/config.yaml``
repeats it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from meshtrain import yaml12
from meshtrain.config.layers import merge
from meshtrain.config.settings import check_settings
from meshtrain.config.spec import NOT_IN_PROFILES, ConfigError, RunSpec

#: Where ``--profile NAME`` looks: the working directory's profiles/ (your own), then the
#: built-in ones shipped inside the package (so an installed meshtrain has them too).
PROFILE_DIRS = [Path.cwd() / "profiles", Path(__file__).resolve().parent.parent / "profiles"]


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
        raw = yaml12.read(path)
    except yaml12.NotText:
        raise ConfigError(f"profile {path}: not UTF-8 text (a binary file?); a profile is a "
                          "YAML file of settings") from None
    except OSError as exc:
        raise ConfigError(f"profile {path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"profile {path}: {yaml12.problem(exc)}") from None
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
