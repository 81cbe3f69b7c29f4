"""DDP's gradient buckets: one cut in every runtime, bit-identical results, and on gloo the
buckets leave during the backward pass."""

from __future__ import annotations

import pytest
import torch
from helpers import WideMLP, assert_states_equal, regression_data
from torch import nn

from meshtrain import Trainer
from meshtrain.comm import ThreadCommunicator, ThreadHub
from meshtrain.comm.buckets import BUCKET_BYTES, GradientBuckets, bucket_layout
from meshtrain.comm.communicator import Communicator, ReduceOp
from meshtrain.strategies import DDP


def test_buckets_are_cut_from_the_last_parameter_at_the_size_cap():
    assert bucket_layout([100, 300, 50, 200, 10], cap=250) == [[4, 3, 2], [1], [0]]
    assert bucket_layout([100, 300], cap=250) == [[1], [0]]
    assert bucket_layout([], cap=250) == [[]]  # the flags still have a bucket to ride in


def test_each_kind_of_tensor_fills_buckets_of_its_own():
    """Tensors of another dtype go in buckets of their own (torch DDP's rule), each kind
    cut at the cap; the bucket of tensor 0 comes last, since the flags take its dtype."""
    f32, f64 = torch.float32, torch.float64
    assert bucket_layout([100, 100, 100], cap=150, kinds=[f32, f64, f32]) == [[1], [2, 0]]
    assert bucket_layout([100, 100, 100], cap=100, kinds=[f32, f64, f32]) == [[2], [1], [0]]
    # tensor 0's float32 bucket fills first; the float64 bucket still open goes before it
    assert bucket_layout([200, 10, 100], cap=150, kinds=[f32, f64, f32]) == [[1], [2, 0]]
    assert bucket_layout([10, 300, 10, 10], cap=150, kinds=[f32, f32, f64, f32]) == [[3, 1], [2], [0]]
    # one kind: the layout without kinds
    assert bucket_layout([100, 300, 50, 200, 10], cap=250, kinds=[f32] * 5) == [[4, 3, 2], [1], [0]]


def test_the_threads_runtime_refuses_a_bucket_of_two_dtypes():
    hub = ThreadHub(1)
    with pytest.raises(ValueError, match="a bucket holds tensors of several dtypes"):
        ThreadCommunicator(hub, 0).all_reduce_buckets([[torch.zeros(2), torch.zeros(2, dtype=torch.float64)]])


class EchoCommunicator(Communicator):
    """Two members that hold the same numbers (a mean is the tensor itself) and can reduce
    in the background: what the overlapped path posted, and when, is visible."""

    reduces_in_background = True

    def __init__(self) -> None:
        super().__init__(0, 2)
        self.reduced_sizes: list[int] = []

    def _ring_all_reduce(self, flat: torch.Tensor, op: ReduceOp, members: list[int]) -> torch.Tensor:
        self.reduced_sizes.append(flat.numel())
        return flat.clone()

    def _all_gather(self, flat: torch.Tensor, members: list[int]) -> list[torch.Tensor]:
        raise NotImplementedError

    def _broadcast(self, flat: torch.Tensor, src: int, members: list[int]) -> torch.Tensor:
        raise NotImplementedError


def _gradients(model: nn.Module, background: bool) -> tuple[list[torch.Tensor], EchoCommunicator, int]:
    """One step's gradients through the buckets: sent during backward (``background``) or
    after it, as the threads runtime does."""
    comm = EchoCommunicator()
    comm.reduces_in_background = background
    params = list(model.parameters())
    buckets = GradientBuckets(comm, params)
    model.zero_grad(set_to_none=True)
    buckets.start_during_backward(0, op="sum", scale=3.0)
    model((torch.ones(4, 6), torch.zeros(4, 2))).backward()
    posted = buckets._flight.posted if buckets._flight is not None else 0
    flags = torch.ones(len(params))
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    buckets.all_reduce_(grads, op="sum", scale=3.0, along=[flags])
    return grads, comm, posted


class Regression(nn.Module):
    """Three buckets, every parameter with a gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                                 nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 2))

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return ((self.net(batch[0]) - batch[1]) ** 2).mean()


def test_overlapped_buckets_leave_during_backward_and_equal_the_buckets_after_it():
    wrapped = Regression()
    after, comm_after, _ = _gradients(wrapped, background=False)
    during, comm_during, posted = _gradients(wrapped, background=True)
    layout = bucket_layout([p.numel() * 4 for p in wrapped.parameters()])
    assert len(layout) == 3
    # Every bucket but the last (it carries the flags) was handed over inside backward.
    assert posted == len(layout) - 1
    assert all(torch.equal(a, b) for a, b in zip(after, during, strict=True))
    assert comm_during.reduced_sizes == comm_after.reduced_sizes
    # The same bytes, bucket by bucket, and both say which buckets a launched run overlaps.
    assert comm_during.log.records == comm_after.log.records
    assert [r.during_backward for r in comm_after.log.records] == [True, True, False]
    params = list(wrapped.parameters())  # and one flag per parameter
    assert sum(comm_during.reduced_sizes) == sum(p.numel() for p in params) + len(params)


@pytest.mark.parametrize("balance", [False, True])
def test_buckets_in_processes_are_bit_identical_to_threads(balance, tmp_path):
    """3 nodes (the ring's chunk boundaries decide the order of a sum), a layer without
    gradients in a middle bucket; with balance, sample-weighted sums."""
    assert sum(p.numel() for p in WideMLP().parameters()) * 4 > 3 * BUCKET_BYTES
    kwargs = dict(nodes=3, max_steps=4, batch_size=6, seed=2, progress=False, shuffle=False,
                  **({"balance": True, "straggler": ["node=1,slowdown=2"]} if balance else {}))
    results = [Trainer(WideMLP(), regression_data(240)).fit(
        DDP("adamw", 0.01), runtime=runtime, out_dir=tmp_path / runtime, **kwargs)
        for runtime in ("threads", "processes")]
    assert_states_equal(results[0].model, results[1].model)
    assert results[0].summary["bytes_sent_per_node"] == results[1].summary["bytes_sent_per_node"]
    unused = results[1].model.unused.weight
    assert torch.equal(unused, WideMLP().unused.weight)  # no gradient anywhere: untouched by AdamW
