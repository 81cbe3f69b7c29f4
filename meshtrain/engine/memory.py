"""Less memory per node, paid in compute or precision: gradient checkpointing and
mixed-precision autocast (the ``gradient_checkpointing`` and ``precision`` settings).

Activations kept for the backward pass are what fills an 8 GB laptop first. Gradient
checkpointing keeps only each layer's input and recomputes the rest during the backward
pass. Autocast runs the forward pass's matrix products in 16-bit floats; weights,
gradients and optimizer state stay fp32, so strategies and their traffic are unchanged.
fp16's narrow range needs loss scaling (:class:`LossScaler`); bf16 has fp32's range.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from meshtrain.errors import SettingError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str, device: torch.device) -> None:
    """Refuse a precision the device cannot autocast to, with one line."""
    if precision == "fp16" and device.type == "cpu":
        raise SettingError("precision fp16 needs a GPU (device cuda or mps): CPUs have no fast fp16; "
                           "use precision bf16 (or fp32) on cpu")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise SettingError("precision bf16: this CUDA GPU has no bfloat16 (older than Ampere); "
                           "use precision fp16")


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The forward pass's precision: nothing for fp32, else torch's autocast to bf16/fp16."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def supports_checkpointing(model: nn.Module) -> bool:
    """Whether ``model`` can recompute its activations (has ``gradient_checkpointing_enable``,
    as Hugging Face models, :class:`~meshtrain.hf.HFModel` and the gpt task's model do)."""
    return callable(getattr(model, "gradient_checkpointing_enable", None))


def enable_checkpointing(model: nn.Module) -> None:
    """Turn on ``model``'s gradient checkpointing (see :func:`supports_checkpointing`)."""
    require_checkpointing(model)
    getattr(model, "gradient_checkpointing_enable")()  # noqa: B009 - a method nn.Module does not declare


def require_checkpointing(model: nn.Module) -> None:
    if not supports_checkpointing(model):
        raise SettingError(f"gradient_checkpointing: model {type(model).__name__} has no "
                           "gradient_checkpointing_enable() method to recompute its activations "
                           "(Hugging Face models and the gpt task have one)")


class LossScaler:
    """Dynamic loss scaling for fp16, as ``torch.amp.GradScaler`` does it, but with the
    overflow decided by every node together (one vote per step), so that all skip alike.

    The loss is multiplied by ``scale`` before the backward pass, keeping small gradients
    above fp16's underflow; gradients are divided by it before the strategy sees them. A
    step whose gradients overflowed on any node is skipped and the scale halved; after
    ``growth_interval`` good steps it doubles.
    """

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale = scale
        self.growth_interval = growth_interval
        self._good_steps = 0

    def unscale(self, params: Sequence[torch.Tensor]) -> bool:
        """Divide the gradients by the scale; whether they are all finite."""
        finite = True
        for p in params:
            if p.grad is not None:
                p.grad.div_(self.scale)
                finite = finite and bool(torch.isfinite(p.grad).all())
        return finite

    def update(self, overflowed: bool) -> None:
        if overflowed:
            self.scale = max(1.0, self.scale / 2)
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps >= self.growth_interval and math.isfinite(self.scale * 2):
            self.scale *= 2
            self._good_steps = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self._good_steps = float(state["scale"]), int(state["good_steps"])
