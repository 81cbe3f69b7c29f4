"""meshtrain: communication-efficient distributed training, simulated or across machines."""

from meshtrain.trainer import FitResult, NodeFailed, TrainConfig, Trainer

__version__ = "0.1.0"

__all__ = ["FitResult", "NodeFailed", "TrainConfig", "Trainer", "__version__"]
