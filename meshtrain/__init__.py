"""meshtrain: communication-efficient distributed training, simulated or across machines."""

import os
import sys

if sys.platform == "darwin":
    # Ops MPS lacks fall back to the CPU instead of failing; torch reads this at import.
    os.environ.setdefault("PYTORCH_ENABLE_MPS_FALLBACK", "1")

from meshtrain.trainer import FitResult, NodeFailed, TrainConfig, Trainer  # noqa: E402 - after the MPS setting

__version__ = "0.1.0"

__all__ = ["FitResult", "NodeFailed", "TrainConfig", "Trainer", "__version__"]
