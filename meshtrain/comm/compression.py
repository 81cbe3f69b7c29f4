"""Compressed averaging of pseudo-gradients (DiLoCo's outer gradient, FedAvg's round delta).

The codecs turn a flat float32 vector into a byte payload and back, in plain torch (CPU,
CUDA, MPS alike; no Triton):

* ``fp32``: no codec; the average is today's ring all-reduce, bit for bit.
* ``bf16``, ``fp16``: each value cast, 2 bytes.
* ``int8``: per block of ``block_size`` values one float32 scale ``max|x| / 127``; each value
  ``round(x / scale)`` in [-127, 127], one byte.
* ``int4``: the same with [-7, 7], stored ``q + 8`` two per byte (low nibble first).
* :class:`SparseCodec` (SparseLoCo): per chunk the top-k values by magnitude, 2 bits each,
  and their indices in the chunk, 12 bits each.

The reduction (:meth:`PseudoGradientCompression.mean_`): every member encodes its own
vector; ONE all-gather of the payloads (every payload has the same length, known to every
member, so a peer's bytes are only ever decoded into numbers of the expected shape); every
member decodes every payload and adds them in float32 in member order, then divides by
the member count. All members add the same decoded numbers in the same order, so all get
the same result bit for bit with no broadcast, and the wire bytes are exactly the payloads:
a node sends its payload to the ``g - 1`` others and receives theirs. A ring that reduces
dequantised sums and re-quantises at every hop would send ``2 (g - 1) / g`` payloads
instead of ``g - 1`` but add one rounding per hop and lose the exact identity of the
members' results; on the 2 to 8 nodes meshtrain simulates and launches the all-gather
costs at most 4x the ring's bytes of the same codec (at 2 nodes they are equal).

With error feedback each member keeps what its payload failed to carry (``x - decode(encode(x))``)
and adds it to its next vector before encoding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from meshtrain.comm.communicator import Communicator, Group

#: The ``compression`` values, in order of bytes per value.
CODECS = ("fp32", "bf16", "fp16", "int8", "int4")
_SCALE_BYTES = 4  # one float32 per block or chunk
_CAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
_LEVELS = {"int8": 127, "int4": 7}


def _scales_to_bytes(scales: torch.Tensor) -> torch.Tensor:
    """[rows, blocks] float32 -> [rows, 4 * blocks] uint8 (native byte order)."""
    return scales.contiguous().view(torch.uint8).reshape(scales.shape[0], -1)


def _bytes_to_scales(raw: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_scales_to_bytes` for one row; a copy, so any offset is aligned."""
    return raw.clone(memory_format=torch.contiguous_format).view(torch.float32)


@dataclass(frozen=True)
class Codec:
    """A dense codec by name (see the module docstring) with ``block_size`` values per scale."""

    name: str = "fp32"
    block_size: int = 128

    def __post_init__(self) -> None:
        if self.name not in CODECS:
            raise ValueError(f"compression must be one of {', '.join(CODECS)}, got {self.name!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"compression_block must be an integer >= 1, got {self.block_size!r}")

    @property
    def lossless(self) -> bool:
        return self.name == "fp32"

    def blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block_size)

    def payload_bytes(self, numel: int) -> int:
        """Bytes one member sends per peer for ``numel`` values: values plus scales, exactly."""
        if self.name == "fp32":
            return 4 * numel
        if self.name in _CAST:
            return 2 * numel
        values = numel if self.name == "int8" else math.ceil(numel / 2)
        return values + _SCALE_BYTES * self.blocks(numel)

    @torch.no_grad()
    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """``[rows, numel]`` float32 -> ``[rows, payload_bytes(numel)]`` uint8."""
        r, n = rows.shape
        if self.name == "fp32":
            return rows.contiguous().view(torch.uint8).reshape(r, -1)
        if self.name in _CAST:
            return rows.to(_CAST[self.name]).contiguous().view(torch.uint8).reshape(r, -1)
        levels = _LEVELS[self.name]
        nb = self.blocks(n)
        if n == nb * self.block_size:  # whole blocks: no padded copy
            blocks = rows.to(torch.float32).contiguous().view(r, nb, self.block_size)
        else:
            padded = torch.zeros(r, nb * self.block_size, dtype=torch.float32, device=rows.device)
            padded[:, :n] = rows
            blocks = padded.view(r, nb, self.block_size)
        scales = blocks.abs().amax(dim=2) / levels
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block stays 0
        q = torch.div(blocks, safe.unsqueeze(2)).round_().clamp_(-levels, levels).view(r, -1)[:, :n]
        if self.name == "int8":
            values = q.to(torch.int8).view(torch.uint8)
        else:
            nibbles = (q + 8).to(torch.uint8)
            if n % 2:
                nibbles = torch.cat([nibbles, torch.full((r, 1), 8, dtype=torch.uint8,
                                                         device=rows.device)], dim=1)
            pairs = nibbles.view(r, -1, 2)
            values = pairs[:, :, 0] | (pairs[:, :, 1] << 4)
        return torch.cat([_scales_to_bytes(scales), values], dim=1)

    @torch.no_grad()
    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """One member's payload (``[payload_bytes(numel)]`` uint8) -> ``[numel]`` float32."""
        if self.name == "fp32":
            return payload.clone().view(torch.float32)
        if self.name in _CAST:
            return payload.clone().view(_CAST[self.name]).to(torch.float32)
        nb = self.blocks(numel)
        scales = _bytes_to_scales(payload[: _SCALE_BYTES * nb])
        raw = payload[_SCALE_BYTES * nb :]
        padded = torch.zeros(nb * self.block_size, dtype=torch.float32, device=payload.device)
        if self.name == "int8":
            padded[:numel] = raw.view(torch.int8)  # int8 -> float32 on the copy
        else:
            pairs = padded[: 2 * raw.numel()].view(-1, 2)
            pairs[:, 0] = raw & 0x0F
            pairs[:, 1] = raw >> 4
            padded[numel:] = 8.0  # the odd value's pad nibble and the last block's tail decode to 0
            padded.sub_(8.0)
        return padded.view(nb, self.block_size).mul_(scales.unsqueeze(1)).view(-1)[:numel]


@dataclass(frozen=True)
class SparseCodec:
    """SparseLoCo's payload: per chunk of ``chunk`` values, the ``topk`` largest by magnitude.

    Per chunk on the wire: one float32 scale ``s = max|v| / 1.5`` over the kept values, each
    value as a 2-bit code ``c = clamp(round(v / s + 1.5), 0, 3)`` meaning ``(c - 1.5) s``
    (levels -1.5s, -0.5s, 0.5s, 1.5s: signed, the largest value exact in magnitude), and
    each index in the chunk as 12 bits (two indices in three bytes). The vector is cut
    into chunks as one flat buffer, the last chunk padded with zeros.
    """

    chunk: int = 4096
    topk: int = 64

    def __post_init__(self) -> None:
        if not 1 <= self.chunk <= 4096:
            raise ValueError(f"chunk must be between 1 and 4096 (indices are 12 bits), got {self.chunk}")
        if not (1 <= self.topk <= self.chunk and self.topk % 4 == 0):
            raise ValueError(f"topk must be a multiple of 4 between 4 and chunk ({self.chunk}), "
                             f"got {self.topk} (4 two-bit values fill a byte)")

    lossless = False

    def chunks(self, numel: int) -> int:
        return math.ceil(numel / self.chunk)

    def chunk_bytes(self) -> int:
        return _SCALE_BYTES + self.topk * 12 // 8 + self.topk * 2 // 8

    def payload_bytes(self, numel: int) -> int:
        return self.chunks(numel) * self.chunk_bytes()

    @torch.no_grad()
    def select(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices, values)`` of each chunk's top-k by magnitude: ``[rows, chunks, topk]``."""
        r, n = rows.shape
        nc = self.chunks(n)
        padded = torch.zeros(r, nc * self.chunk, dtype=torch.float32, device=rows.device)
        padded[:, :n] = rows
        chunked = padded.view(r, nc, self.chunk)
        idx = torch.topk(chunked.abs(), self.topk, dim=2, sorted=False).indices
        idx = idx.sort(dim=2).values  # any order would do; sorted, every platform packs alike
        return idx, torch.gather(chunked, 2, idx)

    @torch.no_grad()
    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """``[rows, numel]`` float32 -> ``[rows, payload_bytes(numel)]`` uint8."""
        r = rows.shape[0]
        idx, vals = self.select(rows)
        nc = idx.shape[1]
        scales = vals.abs().amax(dim=2) / 1.5
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(vals / safe.unsqueeze(2) + 1.5).clamp_(0, 3).to(torch.uint8)
        quads = codes.view(r, nc, -1, 4)
        packed_values = (quads[..., 0] | (quads[..., 1] << 2) | (quads[..., 2] << 4)
                         | (quads[..., 3] << 6))
        pairs = idx.to(torch.int32).view(r, nc, -1, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        packed_idx = torch.stack([a & 0xFF, (a >> 8) | ((b & 0x0F) << 4), b >> 4],
                                 dim=3).to(torch.uint8).view(r, nc, -1)
        per_chunk = torch.cat([scales.contiguous().view(torch.uint8).view(r, nc, _SCALE_BYTES),
                               packed_idx, packed_values], dim=2)
        return per_chunk.reshape(r, -1)

    @torch.no_grad()
    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """One member's payload -> the dense ``[numel]`` float32 vector it stands for."""
        nc = self.chunks(numel)
        per_chunk = payload.view(nc, self.chunk_bytes())
        scales = _bytes_to_scales(per_chunk[:, :_SCALE_BYTES]).view(nc)
        index_bytes = self.topk * 12 // 8
        triples = per_chunk[:, _SCALE_BYTES : _SCALE_BYTES + index_bytes].to(torch.int64)
        triples = triples.view(nc, -1, 3)
        a = triples[..., 0] | ((triples[..., 1] & 0x0F) << 8)
        b = (triples[..., 1] >> 4) | (triples[..., 2] << 4)
        idx = torch.stack([a, b], dim=2).view(nc, self.topk)
        packed = per_chunk[:, _SCALE_BYTES + index_bytes :]
        codes = torch.stack([(packed >> shift) & 3 for shift in (0, 2, 4, 6)], dim=2).view(nc, -1)
        values = (codes.to(torch.float32) - 1.5) * scales.unsqueeze(1)
        dense = torch.zeros(nc, self.chunk, dtype=torch.float32, device=payload.device)
        # Indices are < 4096 by construction but hostile bytes could repeat one: scatter
        # (last write wins) keeps the result in the chunk either way.
        dense.scatter_(1, idx.clamp_(0, self.chunk - 1), values)
        return dense.view(-1)[:numel]


AnyCodec = Codec | SparseCodec


class PseudoGradientCompression:
    """One node's compressed average of its pseudo-gradients, with its error feedback.

    ``error_feedback``: keep what each payload failed to carry and add it to the next
    vector. ``decay`` multiplies the kept residual before the next vector joins it
    (SparseLoCo's ``e = decay * e + delta``; 1.0: plain error feedback).
    """

    def __init__(self, codec: AnyCodec, *, error_feedback: bool = False, decay: float = 1.0) -> None:
        self.codec = codec
        self.error_feedback = error_feedback
        self.decay = decay
        self.residual: torch.Tensor | None = None

    def payload_bytes(self, numel: int) -> int:
        return self.codec.payload_bytes(numel)

    @torch.no_grad()
    def mean_(self, comm: Communicator, tensors: Sequence[torch.Tensor], *, group: Group | None = None,
              weight: float | None = None, stacked_nodes: int | None = None, record: bool = True) -> None:
        """Replace ``tensors`` in place by the mean over ``group`` of what the members' payloads
        carry (see the module docstring). ``weight``: this node's weight (``balance``), sent
        as 4 more bytes; the mean is then ``sum_i w_i x_i / sum_i w_i``. ``stacked_nodes``:
        the vmap runtime's tensors, one row per node."""
        if not tensors:
            return
        rows = stacked_nodes or 1
        flat = torch.cat([t.detach().reshape(rows, -1).to(torch.float32) for t in tensors], dim=1)
        numel = flat.shape[1]
        if self.error_feedback:
            if self.residual is not None:
                flat = flat + (self.residual * self.decay if self.decay != 1.0 else self.residual)
        payload = self.codec.encode(flat)
        if self.error_feedback:
            own = torch.stack([self.codec.decode(row, numel) for row in payload])
            self.residual = flat - own
        if weight is not None:
            sent_weight = torch.full((rows, 1), float(weight), dtype=torch.float32, device=flat.device)
            payload = torch.cat([payload, _scales_to_bytes(sent_weight)], dim=1)
        gathered = comm.all_gather(payload if stacked_nodes else payload[0], group=group, record=record)
        total: torch.Tensor | None = None
        weights = 0.0
        for member in gathered:  # member order: every node adds the same numbers in the same order
            body = member[: self.codec.payload_bytes(numel)]
            decoded = self.codec.decode(body, numel)
            if weight is not None:
                w = _bytes_to_scales(member[self.codec.payload_bytes(numel):])
                decoded = decoded * w
                weights = weights + float(w)
            total = decoded.clone() if total is None else total.add_(decoded)
        assert total is not None
        total.div_(weights if weight is not None else len(gathered))
        offset = 0
        for t in tensors:
            n = t[0].numel() if stacked_nodes else t.numel()
            piece = total[offset : offset + n].to(t.dtype)
            t.copy_(piece.view(t.shape[1:]).expand_as(t) if stacked_nodes else piece.view_as(t))
            offset += n

    def state_dict(self) -> dict[str, Any]:
        return {"residual": None if self.residual is None else self.residual.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("residual")
        self.residual = None if saved is None else saved.clone()


def compression_from(name: str, block_size: int, error_feedback: bool) -> PseudoGradientCompression | None:
    """The compressed average a strategy's ``compression`` options ask for; None for fp32
    (today's exact all-reduce)."""
    codec = Codec(name, block_size)
    if codec.lossless:
        return None
    return PseudoGradientCompression(codec, error_feedback=error_feedback)
