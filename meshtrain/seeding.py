"""Seeds every node derives the same way, so shared random choices need no messages."""

from __future__ import annotations

import torch


def mix_seed(*keys: int) -> int:
    """A stable 63-bit seed from integer keys, e.g. (run seed, step, tensor index)."""
    mixed = 0x2545F4914F6CDD1D
    for k in keys:
        mixed = (mixed * 6364136223846793005 + k + 1442695040888963407) % (1 << 63)
    return mixed


def seeded_generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded by :func:`mix_seed` of the keys."""
    return torch.Generator().manual_seed(mix_seed(*keys))
