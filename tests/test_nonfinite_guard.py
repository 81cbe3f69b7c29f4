"""The non-finite guard's check of a node's gradients (run after every step's backward)."""

from __future__ import annotations

import pytest
import torch

from meshtrain.engine.callbacks import _non_finite


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 4095])
def test_a_non_finite_gradient_anywhere_is_found_a_large_finite_one_is_not(bad: float, where: int) -> None:
    params = [torch.zeros(64, 64, requires_grad=True), torch.zeros(3, requires_grad=True),
              torch.zeros(0, requires_grad=True), torch.zeros(2, requires_grad=True)]
    for p in params[:3]:  # the last one has no gradient
        p.grad = torch.zeros_like(p)
    params[0].grad.view(-1)[where] = 3e38  # finite, though a sum of two would overflow
    params[1].grad[2] = -3e38
    assert _non_finite(0.5, params) is None
    params[0].grad.view(-1)[where] = bad
    assert _non_finite(0.5, params) == "a gradient is not finite"
    assert _non_finite(float("inf"), params) == "loss is inf"
