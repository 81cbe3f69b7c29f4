"""The identities of shared/notes/algorithms.md: each strategy reduces to something simpler."""

from __future__ import annotations

import pytest
import torch
from helpers import MLP, Scalar, regression_data
from torch.testing import assert_close

from meshtrain import Trainer
from meshtrain.comm import ThreadCommunicator, ThreadHub
from meshtrain.strategies import DDP, SPARTA, DeMo, DiLoCo, FedAvg, Optim, OuterSync, Strategy

TOL = dict(rtol=1e-5, atol=1e-6)


def fit(model, data, strategy, tmp_path, **kwargs):
    kwargs.setdefault("shuffle", False)
    return Trainer(model, data).fit(strategy, out_dir=tmp_path, progress=False, **kwargs).model


def assert_models_close(a, b, **tol):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert_close(sa[k], sb[k], **(tol or TOL), msg=lambda m, k=k: f"{k}: {m}")


def assert_models_differ(a, b):
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    assert any(not torch.equal(x, y) for x, y in pairs)


def hand_loop(model, data, optimizer_step, steps, batch):
    """Single-node training written out: samples in order, batch by batch."""
    x, y = data.tensors
    for s in range(steps):
        i = slice(s * batch, (s + 1) * batch)
        loss = model((x[i], y[i]))
        model.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            optimizer_step()
    return model


@pytest.mark.parametrize("optim", [Optim("sgd"), Optim("sgd", momentum=0.9)])
def test_ddp_equals_large_batch_single_node(optim, tmp_path):
    # Node r reads samples r, r+4, r+8, ...: at step s the 4 nodes together read exactly
    # samples s*12 .. s*12+11, the single node's batch of 12.
    nodes, b, steps = 4, 3, 8
    data = regression_data(nodes * b * steps)
    many = fit(MLP(), data, DDP(optim, 0.1), tmp_path / "a", nodes=nodes, max_steps=steps, batch_size=b)
    one = fit(MLP(), data, DDP(optim, 0.1), tmp_path / "b", nodes=1, max_steps=steps,
              batch_size=nodes * b)
    assert_models_close(many, one)
    assert_models_differ(many, MLP())
    # And the single node is the plain loop written out by hand.
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, **optim.kwargs)
    hand_loop(model, data, opt.step, steps, nodes * b)
    assert_models_close(one, model)


def test_ddp_with_shuffled_data_is_not_the_in_order_large_batch(tmp_path):
    """Guards the previous test: the identity depends on reading the same samples."""
    data = regression_data(96)
    many = fit(MLP(), data, DDP("sgd", 0.1), tmp_path / "a", nodes=4, max_steps=8, batch_size=3,
               shuffle=True)
    one = fit(MLP(), data, DDP("sgd", 0.1), tmp_path / "b", nodes=1, max_steps=8, batch_size=12)
    assert_models_differ(many, one)


@pytest.mark.parametrize("steps", [12, 10])  # 10 % 4 != 0: the final sync averages too
def test_diloco_outer_lr1_no_momentum_equals_fedavg(steps, tmp_path):
    inner = Optim("adamw", weight_decay=0.1)
    data = regression_data(99)
    diloco = fit(MLP(), data, DiLoCo(H=4, outer_lr=1.0, outer_momentum=0.0, optim=inner, lr=0.01),
                 tmp_path / "d", nodes=3, max_steps=steps, batch_size=4)
    fedavg = fit(MLP(), data, FedAvg(H=4, optim=inner, lr=0.01), tmp_path / "f", nodes=3,
                 max_steps=steps, batch_size=4)
    assert_models_close(diloco, fedavg)
    # With the paper's outer Nesterov step the result is a different model.
    paper = fit(MLP(), data, DiLoCo(H=4, optim=inner, lr=0.01), tmp_path / "p", nodes=3,
                max_steps=steps, batch_size=4)
    assert_models_differ(paper, fedavg)


def test_diloco_single_node_equals_plain_training(tmp_path):
    data = regression_data(64)
    steps, batch = 10, 6
    trained = fit(MLP(), data, DiLoCo(H=3, outer_lr=1.0, outer_momentum=0.0, optim="adam", lr=0.01),
                  tmp_path, nodes=1, max_steps=steps, batch_size=batch)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    hand_loop(model, data, opt.step, steps, batch)
    assert_models_close(trained, model)


@pytest.mark.parametrize("optim", [Optim("sgd"), Optim("sgd", weight_decay=0.01)])
def test_fedavg_h1_sgd_equals_ddp(optim, tmp_path):
    data = regression_data(96)
    kw = dict(nodes=4, max_steps=10, batch_size=4, shuffle=True, seed=2)
    fedavg = fit(MLP(), data, FedAvg(H=1, optim=optim, lr=0.1), tmp_path / "f", **kw)
    ddp = fit(MLP(), data, DDP(optim, 0.1), tmp_path / "d", **kw)
    assert_models_close(fedavg, ddp)
    assert_models_differ(ddp, MLP())


@pytest.mark.parametrize("selector", ["random", "partitioned"])
def test_sparta_p1_equals_averaging_every_step(selector, tmp_path):
    data = regression_data(96)
    kw = dict(nodes=3, max_steps=10, batch_size=4, shuffle=True, seed=1)
    sparta = fit(MLP(), data, SPARTA(p=1.0, selector=selector, optim="adamw", lr=0.01), tmp_path / "s", **kw)
    fedavg = fit(MLP(), data, FedAvg(H=1, optim="adamw", lr=0.01), tmp_path / "f", **kw)
    assert_models_close(sparta, fedavg)
    # A small p leaves the nodes apart for most parameters: a different global model.
    sparse = fit(MLP(), data, SPARTA(p=0.1, selector=selector, optim="adamw", lr=0.01), tmp_path / "p", **kw)
    assert_models_differ(sparse, fedavg)


def test_demo_full_topk_no_decay_one_node_is_sign_sgd(tmp_path):
    # Chunks of at most 4 per dimension: topk = 16 keeps every coefficient.
    data = regression_data(64)
    steps, batch, lr = 8, 8, 0.01
    trained = fit(MLP(), data, DeMo(lr=lr, compression_decay=0.0, compression_topk=16, compression_chunk=4),
                  tmp_path, nodes=1, max_steps=steps, batch_size=batch)
    model = MLP()

    def sign_step():
        for p in model.parameters():
            p -= lr * torch.sign(p.grad)

    hand_loop(model, data, sign_step, steps, batch)
    assert_models_close(trained, model)
    assert_models_differ(trained, MLP())


class _CheckedDeMo(DeMo):
    """DeMo that gathers every node's weights after each step (unrecorded) to compare them."""

    max_spread: dict[int, float] = {}

    def after_optimizer_step(self, step):
        super().after_optimizer_step(step)
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        everyone = self.comm.all_gather(flat, record=False)
        spread = max(float((x - everyone[0]).abs().max()) for x in everyone)
        _CheckedDeMo.max_spread[step] = max(spread, _CheckedDeMo.max_spread.get(step, 0.0))


def test_demo_replicas_stay_identical_on_every_node(tmp_path):
    """DeMo's replicas_in_sync claim: every node applies the same decoded update, bit for bit."""
    _CheckedDeMo.max_spread.clear()
    model = fit(MLP(), regression_data(96), _CheckedDeMo(lr=0.01, compression_topk=2, compression_chunk=4),
                tmp_path, nodes=3, max_steps=6, batch_size=4, shuffle=True)
    assert sorted(_CheckedDeMo.max_spread) == list(range(6))
    assert max(_CheckedDeMo.max_spread.values()) == 0.0
    assert_models_differ(model, MLP())


def _scalar_diloco_fit(tmp_path, steps, nodes):
    strategy = DiLoCo(H=1, outer_lr=0.7, outer_momentum=0.9, nesterov=True, optim="sgd", lr=1.0)
    return fit(Scalar(0.0), regression_data(16), strategy, tmp_path, nodes=nodes, max_steps=steps,
               batch_size=2)


@pytest.mark.parametrize("nodes", [1, 2])
def test_diloco_nesterov_outer_step_values(nodes, tmp_path):
    # Each inner step is theta_i = theta - 1 (SGD lr 1 on loss = theta), so delta = 1.
    one = _scalar_diloco_fit(tmp_path / "1", 1, nodes)
    two = _scalar_diloco_fit(tmp_path / "2", 2, nodes)
    assert_close(one.theta.detach(), torch.tensor(-1.33))
    assert_close(two.theta.detach(), torch.tensor(-3.227))


def test_outer_sync_directly_on_one_node_hub():
    model = Scalar(0.0)
    strategy = Strategy("sgd", 1.0, modules=[OuterSync(H=1, outer_lr=0.7, outer_momentum=0.9, nesterov=True)])
    comm = ThreadCommunicator(ThreadHub(1), 0)
    strategy.setup(model, comm, seed=0, max_steps=2)
    sync = strategy.modules[0]
    outer_before = sync.outer[0].clone()
    with torch.no_grad():
        model.theta -= 1.0
    assert torch.equal(sync.outer[0], outer_before), "the outer copy aliases the worker"
    sync.sync(0)
    assert_close(model.theta.detach(), torch.tensor(-1.33))
    with torch.no_grad():
        model.theta -= 1.0
    sync.sync(1)
    assert_close(model.theta.detach(), torch.tensor(-3.227))
    assert_close(sync.global_parameters()[0], torch.tensor(-3.227))
    # Without Nesterov (plain momentum): -0.7, then -0.7 - 0.7 * 1.9 = -2.03.
    plain = Strategy("sgd", 1.0, modules=[OuterSync(H=1, outer_lr=0.7, outer_momentum=0.9, nesterov=False)])
    model2 = Scalar(0.0)
    plain.setup(model2, ThreadCommunicator(ThreadHub(1), 0), seed=0, max_steps=2)
    for expected in (-0.7, -2.03):
        with torch.no_grad():
            model2.theta -= 1.0
        plain.modules[0].sync(0)
        assert_close(model2.theta.detach(), torch.tensor(expected))
