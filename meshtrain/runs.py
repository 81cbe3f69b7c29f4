"""Reading finished run directories back: for `meshtrain runs`, `plot` and `compare`.

A finished run is a folder holding ``summary.json``, ``config.yaml`` and ``metrics.csv``
(what :mod:`meshtrain.run_dir` renames into place once every file is written). Anything
else under a runs folder (``.partial`` folders of runs still going, ``.incomplete``
folders kept after a failed write, error logs) is not a finished run.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from meshtrain import yaml12
from meshtrain.errors import InputError
from meshtrain.strategies import STRATEGIES

#: The files every finished run directory holds.
REQUIRED = ("summary.json", "config.yaml", "metrics.csv")



def strategy_label(name: str, options: dict[str, Any]) -> str:
    """``DiLoCo H=25``: a strategy's display name and its key parameters from ``options``
    (as its class declares them; a strategy outside the registry shows its name alone)."""
    cls = STRATEGIES.get(name)
    keys = cls.key_parameters if cls else {}
    params = [f"{label}={options[k]:g}" if isinstance(options[k], float) else f"{label}={options[k]}"
              for k, label in keys.items() if options.get(k) is not None]
    return " ".join([(cls.display_name if cls else None) or name, *params])


class RunError(InputError):
    """A folder that is not a finished run: one line naming it and what is missing."""


@dataclass
class FinishedRun:
    """One finished run directory, read back."""

    path: Path
    summary: dict[str, Any]
    config: dict[str, Any]
    metrics: list[dict[str, float | None]] = field(default_factory=list)

    @property
    def strategy(self) -> str:
        return str(self.summary.get("strategy", "?"))

    @property
    def task(self) -> str:
        """The task name (runs made with ``Trainer.fit`` record the model's class instead)."""
        spec = self.config.get("spec") or {}
        return str(spec.get("task") or self.config.get("model") or "?")

    @property
    def cluster(self) -> str:
        return str((self.summary.get("projected") or {}).get("cluster", "?"))

    @property
    def label(self) -> str:
        """Strategy and its key parameters, e.g. ``DiLoCo H=25``: legends and tables."""
        return strategy_label(self.strategy, self.config.get("strategy") or {})

    def validation(self) -> list[dict[str, float | None]]:
        """The metrics.csv rows holding a validation of the global model (step 0 first)."""
        return [row for row in self.metrics if row.get("val_loss") is not None]

    def metric(self) -> tuple[str, float] | None:
        """The task's own final metric (accuracy, WER), if it has one."""
        for key, value in self.summary.items():
            if key.startswith("final_") and key not in ("final_train_loss", "final_val_loss") \
                    and isinstance(value, (int, float)):
                return key.removeprefix("final_"), float(value)
        return None


def load_run(path: str | Path) -> FinishedRun:
    """Read a finished run directory; :class:`RunError` naming the folder if it is not one."""
    folder = Path(path)
    if not folder.is_dir():
        raise RunError(f"{folder}: no such run directory")
    missing = [name for name in REQUIRED if not (folder / name).is_file()]
    if missing:
        raise RunError(f"{folder}: not a finished run (no {', '.join(missing)})")
    name = "summary.json"  # which file failed to read, for the message
    try:
        summary = yaml12.read_json(folder / name)
        name = "config.yaml"
        config = yaml12.read(folder / name) or {}
        name = "metrics.csv"
        with (folder / name).open(newline="", encoding="utf-8") as f:
            metrics = [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]
    except (UnicodeDecodeError, yaml12.NotText):
        raise RunError(f"{folder / name}: not UTF-8 text (damaged?); not a finished run") from None
    except yaml12.Refused as exc:  # too large, an alias bomb, not JSON, not a regular file
        raise RunError(f"{folder / name}: {exc}; not a finished run") from None
    # It may have come from a host: any bytes, a field over csv's 128 KiB limit, nesting too deep.
    except (OSError, ValueError, RecursionError, csv.Error, yaml.YAMLError) as exc:
        raise RunError(f"{folder / name}: unreadable ({exc}); not a finished run") from None
    if not isinstance(summary, dict) or not isinstance(config, dict) or not metrics:
        raise RunError(f"{folder}: not a finished run (summary, config or metrics are empty)")
    return FinishedRun(folder, summary, config, metrics)


def _number(text: str | None) -> float | None:
    """A metrics.csv cell: a number, or None where the row has no value."""
    if text is None or text == "":
        return None
    return float(text)


@dataclass
class Listing:
    """What a runs folder holds: finished runs, and folders that look like unfinished ones."""

    finished: list[FinishedRun]
    unfinished: list[tuple[Path, str]]  # (folder, why it is not a finished run)


def list_runs(folder: str | Path) -> Listing:
    """Every run under ``folder``, oldest name first; a comparison folder's runs are included.

    Hidden ``.partial`` folders are runs still going (or killed): listed as unfinished, as
    are ``.incomplete`` folders and folders missing one of the run files.
    """
    root = Path(folder)
    if not root.is_dir():
        raise RunError(f"{root}: no such folder")
    listing = Listing([], [])
    for child in sorted(root.iterdir()):
        if not child.is_dir():
            continue  # error logs and other files
        if (child / "comparison.json").is_file():
            nested = list_runs(child)
            listing.finished += nested.finished
            listing.unfinished += nested.unfinished
        elif child.name.endswith(".partial"):
            listing.unfinished.append((child, "still running, or stopped before it finished"))
        elif child.name.endswith(".incomplete"):
            listing.unfinished.append((child, "writing it failed part-way"))
        elif child.name.endswith(".checkpoints"):
            listing.unfinished.append((child, "checkpoints of a stopped run (resume it)"))
        else:
            try:
                listing.finished.append(load_run(child))
            except RunError as exc:
                listing.unfinished.append((child, str(exc).removeprefix(f"{child}: ")))
    return listing


def load_runs(path: str | Path) -> list[FinishedRun]:
    """The run directory ``path``, or every finished run in a folder of them (a comparison
    folder, ``runs/``: as :func:`list_runs` finds them). :class:`RunError` naming ``path``
    if it is a damaged run, or a folder holding no finished run."""
    folder = Path(path)
    if not folder.is_dir() or any((folder / name).is_file() for name in REQUIRED):
        return [load_run(folder)]  # a run directory, or what was meant as one: its error
    found = list_runs(folder).finished
    if not found:
        raise RunError(f"{folder}: not a finished run, nor a folder holding one")
    return found
