"""The strategy set. Each file holds one algorithm, written like its paper.

A new built-in strategy is one file here: every :class:`Strategy` subclass with its own
``name`` in a module of this package joins :data:`STRATEGIES` (in ``listing_order``). Its
name also goes in :data:`meshtrain.config.spec.BUILT_IN_STRATEGIES`, which the --strategy
help reads without importing this package (tests/test_cli_imports.py checks they agree).
"""

import importlib
import pkgutil

from meshtrain.strategies.base import CommunicationModule, Optim, Strategy
from meshtrain.strategies.ddp import DDP, GradientAveraging
from meshtrain.strategies.demo import DeMo
from meshtrain.strategies.diloco import DiLoCo, OuterSync
from meshtrain.strategies.fedavg import FedAvg, ModelAveraging
from meshtrain.strategies.sparseloco import SparseLoCo
from meshtrain.strategies.sparta import SPARTA, SparseAveraging
from meshtrain.strategies.sparta_diloco import SPARTADiLoCo
from meshtrain.strategies.streaming_diloco import StreamingDiLoCo, StreamingOuterSync


def _built_in() -> dict[str, type[Strategy]]:
    """Every strategy class a module of this package defines, by its name."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    found, todo = [], list(Strategy.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith(f"{__name__}.") and "name" in vars(cls):
            found.append(cls)
    return {cls.name: cls for cls in sorted(found, key=lambda c: (c.listing_order, c.name))}


#: Strategies by the name the CLI and profiles use.
STRATEGIES: dict[str, type[Strategy]] = _built_in()

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
    "SparseLoCo",
    "Strategy",
    "StreamingDiLoCo",
    "StreamingOuterSync",
]
