"""meshtrain: communication-efficient distributed training, simulated or across machines.

``import meshtrain`` is light: the API's names load on first use (PEP 562), so the
``meshtrain`` command's commands that never compute (``--help``, ``hosts``, the launching
side of ``launch``) start without torch's 2 s import.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

from meshtrain.interrupts import quiet_ctrl_c_while_importing
from meshtrain.version import __version__

quiet_ctrl_c_while_importing()  # before torch's imports, the slow part of starting

if sys.platform == "darwin":
    # Ops MPS lacks fall back to the CPU instead of failing; torch reads this at its import,
    # which comes after this (every meshtrain module imports this package first).
    os.environ.setdefault("PYTORCH_ENABLE_MPS_FALLBACK", "1")

if TYPE_CHECKING:
    from meshtrain.config.settings import TrainConfig
    from meshtrain.engine.job import FitResult, NodeFailed
    from meshtrain.engine.trainer import Trainer

#: Where each of the API's names is defined.
_API = {
    "FitResult": "meshtrain.engine.job",
    "NodeFailed": "meshtrain.engine.job",
    "TrainConfig": "meshtrain.config.settings",
    "Trainer": "meshtrain.engine.trainer",
}


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'meshtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # the next lookup finds it without coming here
    return value


__all__ = ["FitResult", "NodeFailed", "TrainConfig", "Trainer", "__version__"]
