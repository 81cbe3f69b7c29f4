"""SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025, arXiv 2508.15706; templar).

DiLoCo whose outer gradient travels sparse and in 2 bits, with error feedback in place of
the outer momentum. Every ``H`` steps each node r, from the shared parameters theta::

    delta_r = theta - theta_r                  # its pseudo-gradient
    e_r     = decay * e_r + delta_r            # the error-feedback accumulator (kept locally)
    q_r     = Q(TopK(e_r))                     # per chunk of 4,096 values the 64 largest, 2 bits
    e_r     = e_r - q_r                        # what was sent leaves the accumulator
    theta   = theta - outer_lr * mean_r(q_r)   # a plain averaged step, no outer momentum

``Q`` and the wire format are :class:`~meshtrain.comm.compression.SparseCodec` (a float32
scale, 12-bit indices and 2-bit values per chunk: 116 bytes for 4,096 values); the mean is
the compressed all-gather of :mod:`meshtrain.comm.compression`, added in member order.
"""

from __future__ import annotations

from typing import Any

from meshtrain.comm.compression import PseudoGradientCompression, SparseCodec
from meshtrain.strategies.base import Optim, Strategy
from meshtrain.strategies.diloco import OuterSync


class SparseLoCo(Strategy):
    """SparseLoCo: H inner steps, then a top-k, 2-bit, error-feedback outer step.

    Args:
        H: inner steps between syncs (templar runs 30).
        outer_lr: the outer step's size alpha (theta -= alpha * mean of the sent updates).
        topk, chunk: values kept per chunk (64 of 4,096 in the paper: about 1.6%).
        decay: the accumulator's decay beta before each new pseudo-gradient joins it (0.95).
        optim, lr: the inner optimizer (AdamW, as DiLoCo's).
    """

    name = "sparseloco"
    display_name = "SparseLoCo"
    listing_order = 70
    key_parameters = {"H": "H", "topk": "k"}
    continues_on_fewer_nodes = True  # as DiLoCo: checkpoints fall on outer syncs
    elastic = True  # as DiLoCo: joiners come in at outer syncs
    balances = True  # its average goes through mean_pseudo_gradients_ (sample-weighted)
    supports_vmap = True  # the codec encodes every node's row at once

    def __init__(
        self,
        H: int = 30,
        outer_lr: float = 1.0,
        topk: int = 64,
        chunk: int = 4096,
        decay: float = 0.95,
        optim: str | Optim = Optim("adamw", weight_decay=0.1, betas=(0.9, 0.95)),
        lr: float = 4e-4,
        **common: Any,
    ) -> None:
        if not 0 <= decay <= 1:
            raise ValueError(f"decay must be in [0, 1], got {decay}")
        self.H = H
        self.outer_lr = outer_lr
        self.topk = topk
        self.chunk = chunk
        self.decay = decay
        codec = SparseCodec(chunk, topk)
        compression = PseudoGradientCompression(codec, error_feedback=True, decay=decay)
        # Outer SGD without momentum is theta -= outer_lr * grad: the paper's plain step.
        sync = OuterSync(H, outer_lr, 0.0, False, compression)
        super().__init__(optim, lr, modules=[sync], **common)

    def sync_interval(self) -> int | None:
        return self.H
