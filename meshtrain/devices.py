"""Choosing the device a node trains on."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshtrain.errors import SettingError

if TYPE_CHECKING:  # DEVICES is read where torch is not loaded (an inventory's check)
    import torch

DEVICES = ("auto", "cpu", "cuda", "mps")


def resolve_device(name: str) -> torch.device:
    """``auto`` picks cuda, then mps, then cpu; a named device must be available."""
    import torch

    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    kind = name.split(":")[0]
    if kind not in DEVICES:
        raise ValueError(f"unknown device {name!r}; choose one of: {', '.join(DEVICES)} (cuda:N for GPU N)")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA GPU here")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps' asked for, but this machine has no MPS (Apple GPU)")
    return torch.device(name)


def check_gpus_for_processes(runtime: str, nodes: int, device: torch.device) -> None:
    """The processes runtime on CUDA runs launched ranks' code path, nccl, which refuses two
    ranks on one GPU ("Duplicate GPU detected"): each node process needs a GPU of its own."""
    if runtime != "processes" or device.type != "cuda":
        return
    import torch

    if device.index is not None:
        raise SettingError(f"runtime processes puts node N on GPU N: give device cuda, not {device}")
    gpus = torch.cuda.device_count()
    if nodes > gpus:
        raise SettingError(
            f"runtime processes on cuda: each node process needs a GPU of its own (nccl cannot "
            f"put two on one), and torch sees {gpus} GPU{'s' if gpus != 1 else ''} here for "
            f"{nodes} nodes; use runtime threads or vmap (their nodes share a GPU)")
