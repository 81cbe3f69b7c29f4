"""Strategy construction, parameters, the LR schedule and clipping."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import yaml
from helpers import MLP, Scalar, Sized, regression_data, unequal_factory
from torch.testing import assert_close

from meshtrain import Trainer
from meshtrain.comm import ThreadCommunicator, ThreadHub
from meshtrain.strategies import (
    DDP,
    SPARTA,
    STRATEGIES,
    DeMo,
    DiLoCo,
    FedAvg,
    Optim,
    SparseLoCo,
    SPARTADiLoCo,
    Strategy,
)
from meshtrain.strategies.async_diloco import AsyncDiLoCo
from meshtrain.strategies.base import OPTIMIZERS
from meshtrain.strategies.demo import ChunkedDCT, dct_matrix
from meshtrain.strategies.streaming_diloco import StreamingDiLoCo

COMMON = ["max_norm", "warmup_steps", "lr_schedule", "min_lr"]
COMPRESSION = ["compression", "compression_block", "error_feedback"]
EXPECTED_PARAMETERS = {
    "ddp": ["optim", "lr", *COMMON],
    "diloco": ["H", "delay", "outer_lr", "outer_momentum", "nesterov", *COMPRESSION, "optim", "lr",
               *COMMON],
    "sparta": ["p", "selector", "optim", "lr", *COMMON],
    "sparta-diloco": ["p", "sparse_interval", "selector", "H", "outer_lr", "outer_momentum", "nesterov",
                      *COMPRESSION, "optim", "lr", *COMMON],
    "fedavg": ["H", "island_size", "weighted", *COMPRESSION, "optim", "lr", *COMMON],
    "sparseloco": ["H", "outer_lr", "topk", "chunk", "decay", "optim", "lr", *COMMON],
    "streaming-diloco": ["fragments", "H", "tau", "alpha", "outer_lr", "outer_momentum", "nesterov",
                         *COMPRESSION, "optim", "lr", *COMMON],
    "demo": ["lr", "compression_decay", "compression_topk", "compression_chunk", "weight_decay", *COMMON],
    "async-diloco": ["H", "dylu", "grace", "outer_lr", "outer_momentum", "buffer_size", "momentum_activation",
                     "speeds", "optim", "lr", *COMMON],
}


def test_registry_names():
    assert STRATEGIES == {"ddp": DDP, "diloco": DiLoCo, "sparta": SPARTA, "sparta-diloco": SPARTADiLoCo,
                          "fedavg": FedAvg, "demo": DeMo, "sparseloco": SparseLoCo,
                          "streaming-diloco": StreamingDiLoCo, "async-diloco": AsyncDiLoCo}


@pytest.mark.parametrize("name", list(EXPECTED_PARAMETERS))
def test_parameters_list_the_constructor_arguments(name):
    cls = STRATEGIES[name]
    assert list(cls.parameters()) == EXPECTED_PARAMETERS[name]
    # Every listed parameter is accepted by the constructor and stored under its name.
    strategy = cls()
    config = strategy.config()
    assert config["name"] == name
    assert set(config) == {"name", *EXPECTED_PARAMETERS[name]}
    assert yaml.safe_load(yaml.safe_dump(config))["name"] == name  # config.yaml can hold it
    assert repr(strategy).startswith(type(strategy).__name__ + "(")


@pytest.mark.parametrize("name", list(EXPECTED_PARAMETERS))
def test_unknown_keyword_is_a_type_error(name):
    with pytest.raises(TypeError):
        STRATEGIES[name](no_such_option=1)


def test_demo_takes_no_optimizer():
    with pytest.raises(TypeError):
        DeMo(optim="adam")


def test_options_are_stored():
    s = DiLoCo(H=7, outer_lr=0.5, lr=0.01, max_norm=1.0, warmup_steps=3, lr_schedule="cosine", min_lr=1e-4)
    assert (s.H, s.outer_lr, s.lr, s.max_norm, s.warmup_steps, s.lr_schedule, s.min_lr) == (
        7, 0.5, 0.01, 1.0, 3, "cosine", 1e-4)
    assert DiLoCo().optim == Optim("adamw", weight_decay=0.1, betas=(0.9, 0.95))
    assert (DiLoCo().outer_lr, DiLoCo().outer_momentum, DiLoCo().nesterov) == (0.7, 0.9, True)


@pytest.mark.parametrize(
    "make",
    [
        lambda: DDP(lr=0),
        lambda: DDP(lr_schedule="linear"),
        lambda: DDP(max_norm=0),
        lambda: DDP(optim="lamb"),
        lambda: DiLoCo(H=0),
        lambda: FedAvg(island_size=1),
        lambda: SPARTA(p=0),
        lambda: SPARTA(p=1.5),
        lambda: SPARTA(selector="best"),
        lambda: SPARTADiLoCo(sparse_interval=0),
        lambda: DeMo(compression_topk=0),
    ],
)
def test_bad_values_are_rejected(make):
    with pytest.raises(ValueError):
        make()


def test_optim_builds_with_its_keyword_arguments():
    params = [torch.nn.Parameter(torch.zeros(2))]
    opt = Optim("sgd", momentum=0.9, nesterov=True).build(params, lr=0.3)
    assert isinstance(opt, torch.optim.SGD)
    assert (opt.defaults["lr"], opt.defaults["momentum"], opt.defaults["nesterov"]) == (0.3, 0.9, True)
    assert repr(Optim("adamw", weight_decay=0.1)) == "Optim('adamw', weight_decay=0.1)"


def test_optim_steps_cpu_parameters_with_torchs_list_kernels_unless_told_otherwise():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert Optim("adamw").build(params, lr=0.1).defaults["foreach"] is True
    assert Optim("adamw", foreach=False).build(params, lr=0.1).defaults["foreach"] is False
    chosen = Optim("adam", fused=True).build(params, lr=0.1).defaults
    assert (chosen["fused"], chosen["foreach"]) == (True, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("optim", [Optim("adamw", weight_decay=0.1, betas=(0.9, 0.95)), Optim("adam"),
                                   Optim("sgd", momentum=0.9, nesterov=True, weight_decay=1e-4)])
def test_the_list_kernels_step_bit_for_bit_as_torchs_per_tensor_default(optim, dtype):
    """What the default's comment claims: the same parameters and optimizer state, bit for
    bit, as torch's own CPU default, over steps where some gradients are missing."""
    def train(opt_for):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(dtype)
        opt = opt_for(list(model.parameters()))
        noise = torch.Generator().manual_seed(1)
        for step in range(12):
            for i, p in enumerate(model.parameters()):
                p.grad = None if (step + i) % 5 == 0 else torch.randn(p.shape, generator=noise, dtype=dtype)
            opt.step()
        state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return [*model.parameters(), *state]

    ours = train(lambda params: optim.build(params, lr=0.05))
    torchs = train(lambda params: OPTIMIZERS[optim.name](params, lr=0.05, foreach=False, **optim.kwargs))
    assert len(ours) == len(torchs)
    assert all(torch.equal(a, b) for a, b in zip(ours, torchs, strict=True))


def _schedule(**kw):
    s = Strategy("sgd", 1.0, **kw)
    s.max_steps = 14
    return s


def test_warmup_then_cosine_values():
    s = _schedule(warmup_steps=4, lr_schedule="cosine", min_lr=0.1)
    assert [s.lr_at(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.lr_at(4) == pytest.approx(1.0)  # cosine starts at the peak
    assert s.lr_at(9) == pytest.approx(0.55)  # half-way: min + (peak - min) / 2
    assert s.lr_at(14) == pytest.approx(0.1)  # reaches min_lr at max_steps
    assert s.lr_at(100) == pytest.approx(0.1)
    for i in range(4, 14):
        expected = 0.1 + 0.45 * (1 + math.cos(math.pi * (i - 4) / 10))
        assert s.lr_at(i) == pytest.approx(expected)
    assert all(s.lr_at(i) > s.lr_at(i + 1) for i in range(4, 14))


def test_warmup_then_constant():
    s = _schedule(warmup_steps=2)
    assert [s.lr_at(i) for i in range(5)] == [0.5, 1.0, 1.0, 1.0, 1.0]


def test_the_optimizer_uses_the_schedule(tmp_path):
    # Scalar's gradient is exactly 1: plain SGD moves theta by -lr_at(step) each step.
    strategy = DDP("sgd", 1.0, warmup_steps=2, lr_schedule="cosine", min_lr=0.0)
    res = Trainer(Scalar(0.0), regression_data(16)).fit(strategy, nodes=2, max_steps=6, batch_size=2,
                                                         out_dir=tmp_path, progress=False)
    strategy.max_steps = 6
    lrs = [strategy.lr_at(i) for i in range(6)]
    assert [r["lr"] for r in res.history] == pytest.approx(lrs)
    assert_close(res.model.theta.detach(), torch.tensor(-sum(lrs)))


@pytest.mark.parametrize(("max_norm", "moved"), [(None, 1.0), (0.25, 0.25), (4.0, 1.0)])
def test_max_norm_clips_the_gradient(max_norm, moved, tmp_path):
    res = Trainer(Scalar(0.0), regression_data(16)).fit(
        FedAvg(H=1, optim="sgd", lr=1.0, max_norm=max_norm), nodes=1, max_steps=1, batch_size=2,
        out_dir=tmp_path, progress=False)
    assert_close(res.model.theta.detach(), torch.tensor(-moved))


def test_max_norm_clips_the_global_norm_over_all_tensors():
    model = torch.nn.Linear(3, 2)
    s = Strategy("sgd", 1.0, max_norm=0.5)
    s.setup(model, ThreadCommunicator(ThreadHub(1), 0), seed=0, max_steps=1)
    before = [p.detach().clone() for p in model.parameters()]
    model.weight.grad = torch.full((2, 3), 3.0)
    model.bias.grad = torch.full((2,), 4.0)
    norm = math.sqrt(6 * 9 + 2 * 16)
    s.optimizer_step(0)
    tol = dict(rtol=1e-4, atol=1e-6)
    assert_close(before[0] - model.weight.detach(), torch.full((2, 3), 3.0 * 0.5 / norm), **tol)
    assert_close(before[1] - model.bias.detach(), torch.full((2,), 4.0 * 0.5 / norm), **tol)
    assert model.weight.grad is None  # zeroed for the next step


def test_frozen_parameters_are_not_trained_or_sent(tmp_path):
    model = Sized()
    res = Trainer(model, regression_data(32)).fit(DDP("sgd", 0.1), nodes=2, max_steps=2, batch_size=4,
                                                  out_dir=tmp_path, progress=False)
    assert torch.equal(res.model.frozen, model.frozen)
    assert not torch.equal(res.model.weight, model.weight)
    assert res.summary["trainable_parameters"] == model.weight.numel()
    assert res.summary["parameters"] == model.weight.numel() + model.frozen.numel()


class _RecordingFedAvg(FedAvg):
    """FedAvg that records each node's parameters just before they are averaged."""

    before: dict[int, list[torch.Tensor]] = {}

    def after_optimizer_step(self, step):
        _RecordingFedAvg.before[self.comm.rank] = [p.detach().clone() for p in self.params]
        super().after_optimizer_step(step)


@pytest.mark.parametrize("weighted", [True, False])
def test_fedavg_weights_each_node_by_its_samples(weighted, tmp_path):
    _RecordingFedAvg.before.clear()
    res = Trainer(MLP(), unequal_factory).fit(_RecordingFedAvg(H=1, weighted=weighted, lr=0.1), nodes=3,
                                              max_steps=1, batch_size=4, out_dir=tmp_path, progress=False)
    weights = [16.0, 24.0, 32.0] if weighted else [1.0, 1.0, 1.0]  # unequal_factory: 16 + 8 r samples
    for i, p in enumerate(res.model.parameters()):
        expected = sum(w * _RecordingFedAvg.before[r][i] for r, w in enumerate(weights)) / sum(weights)
        assert_close(p.detach(), expected)


def _sparse_module(selector, p, seed=0):
    strategy = SPARTA(p=p, selector=selector)
    strategy.setup(MLP(), ThreadCommunicator(ThreadHub(1), 0), seed=seed, max_steps=10)
    return strategy.modules[0]


def test_partitioned_selector_covers_every_element_once_per_cycle():
    module = _sparse_module("partitioned", 0.3)  # ceil(1 / 0.3) = 4 partitions
    for cycle in range(2):
        picked = torch.cat([torch.arange(50)[module.indices(cycle * 4 + r, 0, 50)] for r in range(4)])
        assert sorted(picked.tolist()) == list(range(50))
    orders = [[module.indices(c * 4 + r, 0, 50).start for r in range(4)] for c in range(6)]
    assert len({tuple(o) for o in orders}) > 1  # a fresh seeded order each cycle


def test_random_selector_is_seeded_and_differs_by_round_and_tensor():
    a, b = _sparse_module("random", 0.1), _sparse_module("random", 0.1)
    assert torch.equal(a.indices(3, 1, 200), b.indices(3, 1, 200))  # every node derives the same
    assert len(a.indices(3, 1, 200)) == 20
    assert not torch.equal(a.indices(3, 1, 200), a.indices(4, 1, 200))
    assert not torch.equal(a.indices(3, 1, 200), a.indices(3, 2, 200))
    assert not torch.equal(a.indices(3, 1, 200), _sparse_module("random", 0.1, seed=1).indices(3, 1, 200))


@pytest.mark.parametrize("shape", [(8, 6), (12,), (4, 3, 5), (6, 2, 2, 2), (7, 11)])
def test_demo_chunked_dct_round_trip(shape):
    t = ChunkedDCT.for_shape(torch.Size(shape), 4, torch.float64)
    x = torch.randn(shape, dtype=torch.float64)
    coeffs = t.encode(x)
    assert coeffs.shape[1] == t.coefficients_per_chunk <= 16
    assert_close(t.decode(coeffs), x)
    assert_close(coeffs.norm(), x.norm())  # orthonormal: energy preserved
    d = dct_matrix(5, torch.float64)
    assert_close(d @ d.T, torch.eye(5, dtype=torch.float64))


class WithEmptyParameter(torch.nn.Module):
    """An MLP beside a parameter with no elements (a placeholder some models keep)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()
        # In a submodule after the MLP: the MLP's tensors keep their places in the parameter
        # list (a module's own parameters come before its submodules'), and SPARTA seeds its
        # picks by place.
        self.extra = torch.nn.Module()
        self.extra.empty = torch.nn.Parameter(torch.zeros(0, 4))

    def forward(self, batch):  # noqa: ANN001, ANN201 - a test model
        return self.mlp(batch) + self.extra.empty.sum()


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_parameter_with_no_elements_trains_with_every_strategy(name, tmp_path):
    """DeMo cut it into chunks of a divisor of 0 and stopped at its first step."""
    strategy = DeMo(compression_topk=4, compression_chunk=4) if name == "demo" else STRATEGIES[name]()
    plain = Trainer(MLP(), regression_data(96)).fit(
        copy.deepcopy(strategy), nodes=3, max_steps=4, batch_size=4, out_dir=tmp_path, run_id="plain",
        progress=False)
    with_empty = Trainer(WithEmptyParameter(), regression_data(96)).fit(
        strategy, nodes=3, max_steps=4, batch_size=4, out_dir=tmp_path, run_id="empty", progress=False,
        check_sync=True)
    assert with_empty.model.extra.empty.shape == (0, 4)
    # Nothing to learn in it, nothing sent for it: the MLP trains as it does alone.
    assert with_empty.summary["final_train_loss"] == plain.summary["final_train_loss"]


class LinearWeight(torch.nn.Module):
    """One linear map; ``column_major`` stores the same weight transposed in memory (as a
    channels-last convolution or a transposed parameter is): not contiguous. The forward
    multiplies a contiguous copy (exact), so both layouts compute the same losses: a CPU's
    matrix product may add in another order for a transposed operand (this project's AVX-512
    Xeon does, by 5e-7 at the first step), which is torch's, not the strategy's, doing."""

    def __init__(self, column_major: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        weight = torch.randn(2, 6)
        self.weight = torch.nn.Parameter(weight.T.contiguous().T if column_major else weight)

    def forward(self, batch):  # noqa: ANN001, ANN201 - a test model
        x, y = batch
        return ((x @ self.weight.contiguous().T - y) ** 2).mean()


@pytest.mark.parametrize(("strategy", "runtime"), [
    (SPARTA(p=0.3), "threads"), (SPARTA(p=0.3), "vmap"), (SPARTA(p=0.3), "processes"),
    (SPARTA(p=0.3, selector="partitioned"), "threads"), (SPARTA(p=0.3, selector="partitioned"), "vmap"),
    (SPARTADiLoCo(p=0.3, H=2), "threads"), (SPARTADiLoCo(p=0.3, H=2), "vmap"),
], ids=["random-threads", "random-vmap", "random-processes", "partitioned-threads", "partitioned-vmap",
        "sparta-diloco-threads", "sparta-diloco-vmap"])
def test_sparta_picks_the_same_elements_whatever_a_parameters_memory_layout(strategy, runtime, tmp_path):
    """SPARTA flattened each parameter with a view, which a non-contiguous one refuses (a
    channels-last convolution stopped the first step). Its picks are now flat indices in
    row-major order whatever the layout: the run equals the contiguous one bit for bit, and
    the parameter keeps its layout."""
    contiguous, column_major = (
        Trainer(LinearWeight(layout), regression_data(96)).fit(
            copy.deepcopy(strategy), nodes=3, max_steps=6, batch_size=4, out_dir=tmp_path,
            run_id=f"column-major-{layout}", runtime=runtime, progress=False)
        for layout in (False, True))
    assert [r["train_loss"] for r in column_major.history] == [r["train_loss"] for r in contiguous.history]
    assert torch.equal(column_major.model.weight, contiguous.model.weight)
    assert not column_major.model.weight.is_contiguous()


def test_demo_keeps_its_dct_bases_on_the_parameters_device():
    """On a GPU (cuda, or mps on a Mac) the transforms multiply the parameters' residuals:
    bases left on the CPU stopped DeMo's first step there with a device mismatch. The meta
    device stands in for a GPU here (a CPU machine has no other device to put them on)."""
    demo = DeMo(compression_topk=4, compression_chunk=4)
    demo.params = [torch.nn.Parameter(torch.empty(8, 6, device="meta")),
                   torch.nn.Parameter(torch.empty(12, device="meta"))]
    demo.build_optimizer()
    for t in demo.transforms:
        assert t.basis_rows.device.type == t.basis_cols.device.type == "meta"
    assert dct_matrix(5, torch.float32, "meta").device.type == "meta"
    cpu = ChunkedDCT.for_shape(torch.Size((8, 6)), 4, torch.float32)  # the default stays the CPU
    assert cpu.basis_rows.device.type == "cpu"


class _Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv1d(2, 4, 3)

    def forward(self, batch):
        x = batch[0].reshape(-1, 2, 3)
        return self.conv(x).pow(2).mean()


def test_demo_trains_conv_weights(tmp_path):
    """Parameters with more than two dimensions (the reference implementation crashes)."""
    res = Trainer(_Conv(), regression_data(48)).fit(DeMo(lr=0.01, compression_topk=2, compression_chunk=4),
                                                    nodes=2, max_steps=3, batch_size=4, out_dir=tmp_path,
                                                    progress=False)
    moved = (res.model.conv.weight - _Conv().conv.weight).detach() / 0.01
    assert moved.abs().max() > 0.5
    # Sign steps: every element moved by a whole number of lr steps, at most one per step.
    assert_close(moved, moved.round(), rtol=0, atol=1e-3)
    assert moved.abs().max() <= 3 + 1e-3
