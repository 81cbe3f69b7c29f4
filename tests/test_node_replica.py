"""Nodes of one process share frozen weights (LoRA's base model) and own what trains."""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.engine.loop import node_replica


def frozen_base_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2), nn.BatchNorm1d(2))
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model


def test_replicas_share_frozen_weights_and_own_the_rest() -> None:
    model = frozen_base_model()
    a, b = node_replica(model), node_replica(model)
    for (name, p), q, r in zip(model.named_parameters(), a.parameters(), b.parameters(), strict=True):
        if p.requires_grad:
            assert q.data_ptr() != p.data_ptr() and r.data_ptr() != q.data_ptr(), name
            assert torch.equal(q, p)
        else:
            assert q is p and r is p, name
    for mine, theirs in zip(model.buffers(), a.buffers(), strict=True):  # BatchNorm's running stats
        assert mine.data_ptr() != theirs.data_ptr()


def test_training_a_replica_leaves_the_others_alone() -> None:
    model = frozen_base_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    a, b = node_replica(model), node_replica(model)
    optimizer = torch.optim.SGD([p for p in a.parameters() if p.requires_grad], lr=0.5)
    a(torch.randn(8, 64)).pow(2).mean().backward()
    optimizer.step()
    assert not torch.equal(a[2].weight, before["2.weight"])
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert torch.equal(b[2].weight, before["2.weight"])
    assert all(p.grad is None for p in model[0].parameters())


def test_replicas_on_a_device_move_the_callers_model_whole_and_share_its_frozen_weights() -> None:
    """On a GPU the nodes share one copy of the frozen weights on the GPU, and the model the
    caller gave stays on one device ("meta" stands in for the GPU: torch moves to it here)."""
    model = frozen_base_model()
    meta = torch.device("meta")
    a, b = node_replica(model, meta), node_replica(model, meta)
    for t in (*model.parameters(), *model.buffers(), *a.parameters(), *b.parameters()):
        assert t.device == meta  # never half moved
    for p, q, r in zip(model.parameters(), a.parameters(), b.parameters(), strict=True):
        assert (q is p and r is p) == (not p.requires_grad)
