"""meshtrain: communication-efficient distributed training, simulated or across machines."""

import os
import sys

from meshtrain.interrupts import quiet_ctrl_c_while_importing

quiet_ctrl_c_while_importing()  # before torch's imports, the slow part of starting

if sys.platform == "darwin":
    # Ops MPS lacks fall back to the CPU instead of failing; torch reads this at import.
    os.environ.setdefault("PYTORCH_ENABLE_MPS_FALLBACK", "1")

# The API, imported after the MPS setting above (torch reads it at import).
from meshtrain.config.settings import TrainConfig  # noqa: E402
from meshtrain.engine.job import FitResult, NodeFailed  # noqa: E402
from meshtrain.engine.math_kernels import resolve_math_kernels  # noqa: E402
from meshtrain.engine.trainer import Trainer  # noqa: E402
from meshtrain.version import __version__  # noqa: E402

# Before this process's first exp or tanh on several threads, which oneMKL 2024.2 can get
# wrong on one thread's chunk (engine/math_kernels.py): models built after this import,
# and every node, whichever its runtime, compute with the right kernels.
resolve_math_kernels()

__all__ = ["FitResult", "NodeFailed", "TrainConfig", "Trainer", "__version__"]
