"""Choosing the device a node trains on."""

from __future__ import annotations

import torch

DEVICES = ("auto", "cpu", "cuda", "mps")


def resolve_device(name: str) -> torch.device:
    """``auto`` picks cuda, then mps, then cpu; a named device must be available."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    kind = name.split(":")[0]
    if kind not in DEVICES:
        raise ValueError(f"unknown device {name!r}; choose one of {DEVICES}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA GPU here")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps' asked for, but this machine has no MPS (Apple GPU)")
    return torch.device(name)
