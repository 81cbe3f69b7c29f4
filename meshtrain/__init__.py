"""meshtrain: communication-efficient distributed training, simulated or across machines."""

import os
import sys

if sys.platform == "darwin":
    # Ops MPS lacks fall back to the CPU instead of failing; torch reads this at import.
    os.environ.setdefault("PYTORCH_ENABLE_MPS_FALLBACK", "1")

# The API, imported after the MPS setting above (torch reads it at import).
from meshtrain.config.settings import TrainConfig  # noqa: E402
from meshtrain.engine.job import FitResult, NodeFailed  # noqa: E402
from meshtrain.engine.trainer import Trainer  # noqa: E402
from meshtrain.version import __version__  # noqa: E402

__all__ = ["FitResult", "NodeFailed", "TrainConfig", "Trainer", "__version__"]
