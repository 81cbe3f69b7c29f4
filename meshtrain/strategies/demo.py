"""DeMo: Decoupled Momentum optimization (Peng et al., arXiv 2411.19870).

Per parameter p, every step::

    p     *= 1 - lr * weight_decay
    delta  = compression_decay * delta + lr * grad        # local momentum
    q      = top-k of the chunked orthonormal DCT of delta, per chunk
    delta -= IDCT(q)                                      # error feedback
    gather (indices, values) of q from every node
    p     -= lr * sign(IDCT(average of what each coefficient received))

Parameters of any rank work: trailing dimensions are flattened to 2-D first. Indices
travel as int16 (a chunk holds at most 64 * 64 coefficients by default), followed by one
int16 has-gradient flag per tensor. A parameter that got no gradient on a node counts as
a zero gradient there (its momentum still decays and is sent); a parameter with no
gradient on ANY node is left untouched (no weight decay, no momentum decay, no update),
as a torch optimizer skips a parameter whose ``grad`` is None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from meshtrain.strategies.base import Strategy


def dct_matrix(n: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthonormal DCT-II basis: ``D @ x`` transforms, ``D.T @ c`` inverts.

    Computed in float64 on the CPU (MPS has no float64), then moved to ``device``."""
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    basis = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    basis[0] /= math.sqrt(2.0)
    return basis.to(dtype).to(device)


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The chunk length along a dimension of size n (1 for an empty dimension)."""
    return max((d for d in range(1, min(n, limit) + 1) if n % d == 0), default=1)


@dataclass
class ChunkedDCT:
    """The chunked DCT of one parameter shape: to (chunks, coefficients) and back."""

    shape: torch.Size
    rows: int
    cols: int
    chunk_rows: int
    chunk_cols: int
    basis_rows: torch.Tensor
    basis_cols: torch.Tensor

    @classmethod
    def for_shape(cls, shape: torch.Size, chunk: int, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> ChunkedDCT:
        """The transform of a parameter of ``shape``; its bases on the parameter's ``device``."""
        # Rank >= 2 (conv weights too) flattens to (dim0, rest); rank <= 1 is one row.
        if len(shape) >= 2:
            rows, cols = shape[0], math.prod(shape[1:])
            chunk_rows = largest_divisor_at_most(rows, chunk)
        else:
            rows, cols = 1, max(1, math.prod(shape))
            chunk_rows = 1
        chunk_cols = largest_divisor_at_most(cols, chunk)
        return cls(shape, rows, cols, chunk_rows, chunk_cols,
                   dct_matrix(chunk_rows, dtype, device), dct_matrix(chunk_cols, dtype, device))

    @property
    def coefficients_per_chunk(self) -> int:
        return self.chunk_rows * self.chunk_cols

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Parameter-shaped tensor -> (num_chunks, chunk_rows * chunk_cols) DCT coefficients."""
        r, c = self.chunk_rows, self.chunk_cols
        blocks = x.reshape(self.rows // r, r, self.cols // c, c).permute(0, 2, 1, 3)
        coeffs = self.basis_rows @ blocks @ self.basis_cols.T
        return coeffs.reshape(-1, r * c)

    def decode(self, coeffs: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`encode`."""
        r, c = self.chunk_rows, self.chunk_cols
        blocks = coeffs.reshape(self.rows // r, self.cols // c, r, c)
        x = self.basis_rows.T @ blocks @ self.basis_cols
        return x.permute(0, 2, 1, 3).reshape(self.shape)


class DeMo(Strategy):
    """DeMo: sign-SGD on the averaged top-k DCT components of local momentum.

    Args:
        lr: learning rate of the sign step.
        compression_decay: momentum decay of the local residual delta.
        compression_topk: coefficients sent per chunk.
        compression_chunk: largest chunk length along each dimension.
        weight_decay: decoupled weight decay.
    """

    name = "demo"
    display_name = "DeMo"
    listing_order = 60
    key_parameters = {"compression_topk": "topk"}
    # Not continues_on_fewer_nodes: each node's residual holds gradient never applied anywhere.
    replicas_in_sync = True  # every node applies the same decoded update

    def __init__(
        self,
        lr: float = 1e-3,
        compression_decay: float = 0.999,
        compression_topk: int = 32,
        compression_chunk: int = 64,
        weight_decay: float = 0.0,
        **common: Any,
    ) -> None:
        if compression_topk < 1 or compression_chunk < 1:
            raise ValueError("compression_topk and compression_chunk must be >= 1")
        if compression_topk > compression_chunk**2:
            # A chunk holds at most chunk x chunk coefficients: more cannot be sent.
            raise ValueError(f"compression_topk ({compression_topk}) must not exceed the "
                             f"coefficients of a chunk, compression_chunk^2 = {compression_chunk**2}")
        if not 0 <= compression_decay <= 1:
            raise ValueError(f"compression_decay must be in [0, 1], got {compression_decay}")
        self.compression_decay = compression_decay
        self.compression_topk = compression_topk
        self.compression_chunk = compression_chunk
        self.weight_decay = weight_decay
        super().__init__("sgd", lr, **common)

    @classmethod
    def parameters(cls) -> dict[str, Any]:
        found = super().parameters()
        found.pop("optim")  # DeMo is its own optimizer
        return found

    def build_optimizer(self) -> None:
        self.transforms = [
            ChunkedDCT.for_shape(p.shape, self.compression_chunk, p.dtype, p.device) for p in self.params
        ]
        self.deltas = [torch.zeros_like(p) for p in self.params]
        return None

    def _index_dtype(self, t: ChunkedDCT) -> torch.dtype:
        return torch.int16 if t.coefficients_per_chunk <= 2**15 else torch.int32

    @torch.no_grad()
    def optimizer_step(self, step: int) -> None:
        lr = self.lr_at(step)
        if self.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        grads = self.grads()
        had_grad = self.grad_flags.tolist()
        sent_idx, sent_val = [], []
        # The new residual of a parameter without a local gradient is kept aside: it is
        # committed only if some node had a gradient for it (known after the gather).
        pending: list[torch.Tensor | None] = []
        for g, delta, t, here in zip(grads, self.deltas, self.transforms, had_grad, strict=True):
            if here:
                residual = delta.mul_(self.compression_decay).add_(g, alpha=lr)
                pending.append(None)
            else:
                residual = delta * self.compression_decay  # a zero gradient adds nothing
                pending.append(residual)
            coeffs = t.encode(residual)
            k = min(self.compression_topk, t.coefficients_per_chunk)
            idx = coeffs.abs().topk(k, dim=1, sorted=False).indices
            val = coeffs.gather(1, idx)
            residual.sub_(t.decode(torch.zeros_like(coeffs).scatter_(1, idx, val)))
            sent_idx.append(idx.to(self._index_dtype(t)).reshape(-1))
            sent_val.append(val.reshape(-1))
        # Two collectives for the whole model: all values, then all indices (compact ints)
        # with the has-gradient flags appended (one more per further dtype, if any).
        all_val = self._gather_by_dtype(sent_val)
        gathered = self._gather_by_dtype([*sent_idx, self.grad_flags.to(torch.int16)])
        used = torch.stack([row[-1] for row in gathered]).amax(0).tolist()
        for index, (p, t, delta, kept, anywhere) in enumerate(
            zip(self.params, self.transforms, self.deltas, pending, used, strict=True)
        ):
            if not anywhere:  # no node had a gradient: untouched, as torch leaves it
                continue
            if kept is not None:
                delta.copy_(kept)
            p.mul_(1 - lr * self.weight_decay)
            chunks = t.rows // t.chunk_rows * (t.cols // t.chunk_cols)
            total = torch.zeros(chunks, t.coefficients_per_chunk, dtype=p.dtype, device=p.device)
            count = torch.zeros_like(total)
            sent = min(self.compression_topk, t.coefficients_per_chunk)  # per chunk (none: no chunks)
            for node_val, node_idx in zip(all_val, gathered, strict=True):
                i = node_idx[index].long().reshape(chunks, sent)
                v = node_val[index].reshape(chunks, sent)
                total.scatter_add_(1, i, v)
                count.scatter_add_(1, i, torch.ones_like(v))
            averaged = total / count.clamp(min=1)  # over the nodes that sent each coefficient
            p.sub_(torch.sign(t.decode(averaged)), alpha=lr)
        for p in self.params:
            p.grad = None

    def _gather_by_dtype(self, pieces: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Every node's ``pieces`` (alive nodes, in order; each node's list in the order
        given). Pieces of one dtype travel in one all-gather, so none is widened: a model
        with float32 and float64 parameters (or bf16 beside fp32), or indices of two widths."""
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, piece in enumerate(pieces):
            by_dtype.setdefault(piece.dtype, []).append(i)
        per_node: list[list[torch.Tensor]] = [list(pieces) for _ in range(self.comm.size)]
        for members in by_dtype.values():
            gathered = self.comm.all_gather(torch.cat([pieces[i] for i in members]))
            for node, flat in enumerate(gathered):
                for i, piece in zip(members, flat.split([pieces[i].numel() for i in members]), strict=True):
                    per_node[node][i] = piece
        return per_node

    def state_dict(self) -> dict[str, Any]:
        return {"deltas": [d.clone() for d in self.deltas], "modules": []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for d, saved in zip(self.deltas, state["deltas"], strict=True):
            d.copy_(saved)
