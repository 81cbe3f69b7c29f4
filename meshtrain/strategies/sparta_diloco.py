"""SPARTA + DiLoCo: sparse averaging every few steps inside DiLoCo's inner loop.

Built from the two communication modules: the sparse exchange keeps the workers
close, which is reported to allow a much larger H.
"""

from __future__ import annotations

from typing import Any

from meshtrain.strategies.base import CommunicationModule
from meshtrain.strategies.diloco import OuterSGDStrategy, OuterSync
from meshtrain.strategies.sparta import SparseAveraging


class SPARTADiLoCo(OuterSGDStrategy):
    """SPARTA every ``sparse_interval`` steps, DiLoCo outer sync every ``H`` steps.

    ``p``, ``selector``: as SPARTA's; the outer sync's arguments and ``compression``,
    ``compression_block``, ``error_feedback``: as DiLoCo's, for the outer gradient (SPARTA's
    sparse averages stay exact).
    """

    name = "sparta-diloco"
    display_name = "SPARTA+DiLoCo"
    listing_order = 40
    key_parameters = {"p": "p", "H": "H"}
    continues_on_fewer_nodes = True  # as DiLoCo: checkpoints fall on outer syncs
    elastic = True  # as DiLoCo: joiners come in at outer syncs
    balances = True  # its averages go through mean_over_nodes_ (engine/balance.py)
    supports_vmap = True

    def __init__(
        self,
        p: float = 0.005,
        sparse_interval: int = 1,
        selector: str = "random",
        H: int = 100,
        **shared: Any,
    ) -> None:
        self.p = p
        self.sparse_interval = sparse_interval
        self.selector = selector
        self.H = H
        super().__init__(**shared)

    def outer_modules(self) -> list[CommunicationModule]:
        return [
            SparseAveraging(self.p, self.selector, self.sparse_interval),
            OuterSync(self.H, self.outer_lr, self.outer_momentum, self.nesterov, self.new_compression()),
        ]

    def sync_interval(self) -> int | None:
        return self.H
