"""The strategy set. Each file holds one algorithm, written like its paper."""

from meshtrain.strategies.base import CommunicationModule, Optim, Strategy
from meshtrain.strategies.ddp import DDP, GradientAveraging
from meshtrain.strategies.demo import DeMo
from meshtrain.strategies.diloco import DiLoCo, OuterSync
from meshtrain.strategies.fedavg import FedAvg, ModelAveraging
from meshtrain.strategies.sparta import SPARTA, SparseAveraging
from meshtrain.strategies.sparta_diloco import SPARTADiLoCo

#: Strategies by the name the CLI and profiles use.
STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (DDP, DiLoCo, SPARTA, SPARTADiLoCo, FedAvg, DeMo)
}

__all__ = [
    "DDP",
    "STRATEGIES",
    "SPARTA",
    "CommunicationModule",
    "DeMo",
    "DiLoCo",
    "FedAvg",
    "GradientAveraging",
    "ModelAveraging",
    "Optim",
    "OuterSync",
    "SPARTADiLoCo",
    "SparseAveraging",
    "Strategy",
]
