"""SPARTA + DiLoCo: sparse averaging every few steps inside DiLoCo's inner loop.

Built from the two communication modules: the sparse exchange keeps the workers
close, which is reported to allow a much larger H.
"""

from __future__ import annotations

from typing import Any

from meshtrain.comm.compression import compression_from
from meshtrain.strategies.base import Optim, Strategy
from meshtrain.strategies.diloco import OuterSync
from meshtrain.strategies.sparta import SparseAveraging


class SPARTADiLoCo(Strategy):
    """SPARTA every ``sparse_interval`` steps, DiLoCo outer sync every ``H`` steps.

    ``compression``, ``compression_block``, ``error_feedback``: as DiLoCo's, for the outer
    gradient (SPARTA's sparse averages stay exact).
    """

    name = "sparta-diloco"
    display_name = "SPARTA+DiLoCo"
    listing_order = 40
    key_parameters = {"p": "p", "H": "H"}
    continues_on_fewer_nodes = True  # as DiLoCo: checkpoints fall on outer syncs
    balances = True  # its averages go through mean_over_nodes_ (engine/balance.py)
    supports_vmap = True

    def __init__(
        self,
        p: float = 0.005,
        sparse_interval: int = 1,
        selector: str = "random",
        H: int = 100,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        compression: str = "fp32",
        compression_block: int = 128,
        error_feedback: bool = False,
        optim: str | Optim = Optim("adamw", weight_decay=0.1, betas=(0.9, 0.95)),
        lr: float = 4e-4,
        **common: Any,
    ) -> None:
        self.p = p
        self.sparse_interval = sparse_interval
        self.selector = selector
        self.H = H
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.nesterov = nesterov
        self.compression = compression
        self.compression_block = compression_block
        self.error_feedback = error_feedback
        modules = [
            SparseAveraging(p, selector, sparse_interval),
            OuterSync(H, outer_lr, outer_momentum, nesterov,
                      compression_from(compression, compression_block, error_feedback)),
        ]
        super().__init__(optim, lr, modules=modules, **common)

    def sync_interval(self) -> int | None:
        return self.H
