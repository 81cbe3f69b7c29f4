"""Strategies against independent plain-PyTorch references written from the papers.

Each reference below is the algorithm spelled out with torch tensors and torch optimizers,
one model copy per node, without meshtrain's helpers. Where an algorithm draws random
choices that every node derives from a seed (FedAvg's islands, SPARTA's indices), the
reference takes those choices as an input; their own properties are tested separately.
"""

from __future__ import annotations

import copy

import pytest
import scipy.fft
import torch
from helpers import MLP, regression_data, unequal_factory
from torch import nn
from torch.testing import assert_close
from torch.utils.data import TensorDataset

from meshtrain import Trainer
from meshtrain.comm import ThreadCommunicator, ThreadHub
from meshtrain.strategies import DDP, SPARTA, DeMo, DiLoCo, FedAvg, Optim, SPARTADiLoCo

TOL = dict(rtol=1e-5, atol=1e-6)


def fit(model, data, strategy, tmp_path, **kwargs):
    kwargs.setdefault("shuffle", False)
    kwargs.setdefault("progress", False)
    return Trainer(model, data).fit(strategy, out_dir=tmp_path, **kwargs)


def node_batch(data: TensorDataset, step: int, batch: int) -> tuple[torch.Tensor, ...]:
    """Batch ``step`` of a node reading its own dataset in order, dropping the last partial batch."""
    per_epoch = len(data) // batch
    start = (step % per_epoch) * batch
    return tuple(t[start : start + batch] for t in data.tensors)


def assert_params_close(model: nn.Module, expected: list[torch.Tensor], **tol) -> None:
    for (name, p), e in zip(model.named_parameters(), expected, strict=True):
        assert_close(p.detach(), e, **(tol or TOL), msg=lambda m, n=name: f"{n}: {m}")


def assert_params_differ(model: nn.Module, other: list[torch.Tensor]) -> None:
    assert any(not torch.allclose(p.detach(), o, **TOL) for p, o in zip(model.parameters(), other,
                                                                           strict=True))


# ------------------------------------------------------------------------------- FedAvg
def islands_of_run(nodes: int, island_size: int, seed: int, rounds: int) -> list[list[list[int]]]:
    """The seeded island split of each round, as every node of a run computes it."""
    strategy = FedAvg(H=1, island_size=island_size)
    strategy.setup(MLP(), ThreadCommunicator(ThreadHub(nodes), 0), seed=seed, max_steps=1)
    return [strategy.modules[0].islands(r) for r in range(rounds)]


def reference_fedavg(
    datasets: list[TensorDataset], *, H: int, steps: int, batch: int, lr: float, weighted: bool,
    islands: list[list[list[int]]] | None, final_weighted: bool | None = None,
) -> list[torch.Tensor]:
    """FedAvg (McMahan et al. 2017) with island rounds, plain torch.

    Every node runs SGD locally; every H steps each island replaces its members' parameters
    by their mean weighted by n_i (the node's sample count) or unweighted. The global model
    after the last step is the same mean over ALL nodes (``final_weighted`` overrides its
    weighting, to build the wrong answer a test must tell apart).
    """
    n = len(datasets)
    models = [MLP() for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in models]
    weights = [float(len(d)) if weighted else 1.0 for d in datasets]

    def mean_over(members: list[int]) -> list[torch.Tensor]:
        total = sum(weights[r] for r in members)
        per_tensor = zip(*[list(models[r].parameters()) for r in members], strict=True)
        return [sum(weights[r] * t.detach() for r, t in zip(members, ts, strict=True)) / total
                for ts in per_tensor]

    for s in range(steps):
        for r, (m, opt) in enumerate(zip(models, opts, strict=True)):
            opt.zero_grad()
            m(node_batch(datasets[r], s, batch)).backward()
            opt.step()
        if (s + 1) % H == 0:
            groups = islands[s // H] if islands is not None else [list(range(n))]
            for group in groups:
                mean = mean_over(group)
                with torch.no_grad():
                    for r in group:
                        for p, v in zip(models[r].parameters(), mean, strict=True):
                            p.copy_(v)
    if final_weighted is not None and final_weighted != weighted:
        weights = [float(len(d)) if final_weighted else 1.0 for d in datasets]
    return mean_over(list(range(n)))


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("steps", [8, 7])  # 7: the last round is cut short before the final sync
def test_fedavg_islands_end_on_the_weighted_mean_of_all_nodes(weighted, steps, tmp_path):
    nodes, island, H, batch, lr, seed = 4, 2, 2, 4, 0.1, 4
    result = fit(MLP(), unequal_factory, FedAvg(H=H, island_size=island, weighted=weighted, lr=lr),
                 tmp_path, nodes=nodes, max_steps=steps, batch_size=batch, seed=seed)
    datasets = [unequal_factory(r, nodes, "train") for r in range(nodes)]
    assert [len(d) for d in datasets] == [16, 24, 32, 40]
    islands = islands_of_run(nodes, island, seed, steps // H)
    expected = reference_fedavg(datasets, H=H, steps=steps, batch=batch, lr=lr, weighted=weighted,
                                islands=islands)
    assert_params_close(result.model, expected)
    # The test tells the two means apart: the other weighting is a different model.
    other = reference_fedavg(datasets, H=H, steps=steps, batch=batch, lr=lr, weighted=not weighted,
                             islands=islands)
    assert_params_differ(result.model, other)
    # Nor is it weighted rounds ending on a plain mean (or plain rounds on a weighted one).
    mixed = reference_fedavg(datasets, H=H, steps=steps, batch=batch, lr=lr, weighted=weighted,
                             islands=islands, final_weighted=not weighted)
    assert_params_differ(result.model, mixed)


def test_fedavg_weighted_without_islands_is_the_reference(tmp_path):
    nodes, H, steps, batch, lr = 3, 3, 7, 4, 0.1
    result = fit(MLP(), unequal_factory, FedAvg(H=H, weighted=True, lr=lr), tmp_path, nodes=nodes,
                 max_steps=steps, batch_size=batch)
    datasets = [unequal_factory(r, nodes, "train") for r in range(nodes)]
    expected = reference_fedavg(datasets, H=H, steps=steps, batch=batch, lr=lr, weighted=True,
                                islands=None)
    assert_params_close(result.model, expected)


def test_fedavg_weighted_global_model_between_syncs_is_the_weighted_mean(tmp_path):
    """Mid-training validation evaluates the same global model the run ends on."""
    nodes, batch, lr = 3, 4, 0.1
    val = regression_data(8, seed=5)

    def factory(rank, n, split):
        return unequal_factory(rank, n, split) if split == "train" else val

    # H larger than the run: the only average is the final one, so the evaluation after
    # step 2 (val_interval=2) sees the nodes apart and must weight them.
    trainer = Trainer(MLP(), factory, factory)
    result = trainer.fit(FedAvg(H=100, weighted=True, lr=lr), nodes=nodes, max_steps=2,
                         batch_size=batch, val_interval=1, shuffle=False, out_dir=tmp_path,
                         progress=False)
    datasets = [unequal_factory(r, nodes, "train") for r in range(nodes)]
    after_one = reference_fedavg(datasets, H=100, steps=1, batch=batch, lr=lr, weighted=True,
                                 islands=None)
    model = copy.deepcopy(MLP())
    with torch.no_grad():
        for p, v in zip(model.parameters(), after_one, strict=True):
            p.copy_(v)
        expected = model(val.tensors).item()
    assert result.history[0]["val_loss"] == pytest.approx(expected, rel=1e-5)


# ------------------------------------------------------------------------------- SPARTA
def sparse_module(p: float, selector: str = "random", seed: int = 0):
    strategy = SPARTA(p=p, selector=selector)
    strategy.setup(MLP(), ThreadCommunicator(ThreadHub(1), 0), seed=seed, max_steps=1)
    return strategy.modules[0]


@pytest.mark.parametrize("p", [0.005, 0.05, 0.25, 0.3, 0.9])
@pytest.mark.parametrize("numel", [7, 50, 1000, 100_003])
def test_random_selector_draws_distinct_indices(p, numel):
    module = sparse_module(p)
    k = max(1, round(p * numel))
    for sync_round in range(3):
        picked = module.indices(sync_round, 0, numel)
        assert picked.numel() == k
        assert picked.unique().numel() == k, f"{k - picked.unique().numel()} repeated indices"
        assert 0 <= int(picked.min()) and int(picked.max()) < numel


@pytest.mark.parametrize(("p", "numel"), [(0.25, 20), (0.6, 20)])  # both sampling paths
def test_random_selector_is_uniform(p, numel):
    """Every element is picked with probability k / numel (a chi-square bound over rounds)."""
    module = sparse_module(p)
    k, rounds = round(p * numel), 4000
    counts = torch.zeros(numel)
    for sync_round in range(rounds):
        counts[module.indices(sync_round, 0, numel)] += 1
    expected = rounds * k / numel
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 45.3, counts  # the 0.999 quantile of chi-square with 19 degrees of freedom


class _RecordingSPARTA(SPARTA):
    """SPARTA that records every node's parameters around each sparse average."""

    before: dict[tuple[int, int], list[torch.Tensor]] = {}
    after: dict[tuple[int, int], list[torch.Tensor]] = {}

    def after_optimizer_step(self, step):
        key = (self.comm.rank, step)
        _RecordingSPARTA.before[key] = [p.detach().clone() for p in self.params]
        super().after_optimizer_step(step)
        _RecordingSPARTA.after[key] = [p.detach().clone() for p in self.params]


def sharded_batch(data: TensorDataset, rank: int, nodes: int, step: int, batch: int):
    """Node ``rank``'s batch ``step``: samples rank, rank + nodes, ... in order."""
    rows = torch.arange(rank, len(data) - len(data) % nodes, nodes)[step * batch : (step + 1) * batch]
    return tuple(t[rows] for t in data.tensors)


def reference_sparta(data, nodes, steps, batch, lr, picks) -> list[torch.Tensor]:
    """SPARTA, plain torch: SGD locally, then the picked elements of every tensor replaced by
    their mean over the nodes; after the last step the global model is the mean of the nodes.
    ``picks[step][tensor]`` are the flat indices averaged (the seeded choice, an input here)."""
    models = [MLP() for _ in range(nodes)]
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in models]
    for s in range(steps):
        for r, (m, opt) in enumerate(zip(models, opts, strict=True)):
            opt.zero_grad()
            m(sharded_batch(data, r, nodes, s, batch)).backward()
            opt.step()
        with torch.no_grad():
            for i, tensors in enumerate(zip(*[list(m.parameters()) for m in models], strict=True)):
                ix = picks[s][i]
                mean = torch.stack([t.view(-1)[ix] for t in tensors]).mean(0)
                for t in tensors:
                    t.view(-1)[ix] = mean
    return [torch.stack([t.detach() for t in ts]).mean(0)
            for ts in zip(*[list(m.parameters()) for m in models], strict=True)]


@pytest.mark.parametrize("p", [0.3, 0.9])
def test_sparta_averages_exactly_p_of_every_tensor_and_matches_the_reference(p, tmp_path):
    # SGD (not Adam, whose first steps are +-lr on every node) keeps every element of the
    # nodes apart before each average, so the elements an average made equal are visible.
    nodes, steps, batch, lr, seed = 3, 6, 4, 0.1, 5
    data = regression_data(96)
    _RecordingSPARTA.before.clear()
    _RecordingSPARTA.after.clear()
    result = fit(MLP(), data, _RecordingSPARTA(p=p, optim="sgd", lr=lr), tmp_path, nodes=nodes,
                 max_steps=steps, batch_size=batch, seed=seed)
    shapes = [t.numel() for t in MLP().parameters()]  # 48, 8, 16, 2
    module = sparse_module(p, seed=seed)
    picks = [[module.indices(s, i, n) for i, n in enumerate(shapes)] for s in range(steps)]
    for s in range(steps):
        for i, n in enumerate(shapes):
            before = torch.stack([_RecordingSPARTA.before[(r, s)][i].view(-1) for r in range(nodes)])
            after = torch.stack([_RecordingSPARTA.after[(r, s)][i].view(-1) for r in range(nodes)])
            # Measured from what the nodes hold: the elements the step made equal everywhere.
            assert bool((before != before[0]).any(0).all()), "nodes must start the average apart"
            averaged = (after == after[0]).all(0)
            assert int(averaged.sum()) == max(1, round(p * n)), (s, i)
            # Those hold the mean of the nodes; every other element is untouched.
            assert_close(after[:, averaged], before[:, averaged].mean(0).expand(nodes, -1), **TOL)
            assert torch.equal(after[:, ~averaged], before[:, ~averaged])
            assert set(picks[s][i].tolist()) == set(averaged.nonzero().view(-1).tolist())
    expected = reference_sparta(data, nodes, steps, batch, lr, picks)
    assert_params_close(result.model, expected)


# -------------------------------------------------------------------- missing gradients
class Branchy(nn.Module):
    """A body and head every batch uses, a branch only batches with a marker use, and a
    branch nothing uses (its parameters never get a gradient)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 2)
        self.partial = nn.Linear(8, 2)
        self.unused = nn.Linear(8, 2)

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y, marker = batch
        h = torch.tanh(self.body(x))
        out = self.head(h)
        if bool(marker.any()):
            out = out + self.partial(h)
        return ((out - y) ** 2).mean()


def marked_data(n: int, nodes: int) -> TensorDataset:
    """Regression samples; those node 0 reads (index % nodes == 0) carry the marker."""
    x, y = regression_data(n).tensors
    return TensorDataset(x, y, (torch.arange(n) % nodes == 0).to(torch.int64))


class _GradRecordingDDP(DDP):
    """DDP that records, per node and step, which gradients are None after averaging and
    the parameters after the step."""

    none: dict[tuple[int, int], list[bool]] = {}
    params_after: dict[tuple[int, int], list[torch.Tensor]] = {}

    def before_optimizer_step(self, step):
        super().before_optimizer_step(step)
        _GradRecordingDDP.none[(self.comm.rank, step)] = [p.grad is None for p in self.params]

    def after_optimizer_step(self, step):
        super().after_optimizer_step(step)
        _GradRecordingDDP.params_after[(self.comm.rank, step)] = [p.detach().clone() for p in self.params]


def test_ddp_leaves_parameters_without_gradients_untouched_as_torch_does(tmp_path):
    nodes, steps, batch, lr, wd = 3, 6, 4, 0.01, 0.1
    data = marked_data(nodes * batch * steps, nodes)
    optim = Optim("adamw", weight_decay=wd)
    _GradRecordingDDP.none.clear()
    _GradRecordingDDP.params_after.clear()
    result = fit(Branchy(), data, _GradRecordingDDP(optim, lr), tmp_path, nodes=nodes, max_steps=steps,
                 batch_size=batch)
    # Plain torch, one process: the DDP gradient is the gradient of the mean of the nodes'
    # losses (a branch a node did not use contributes zero); a parameter no loss touched
    # keeps grad None, and AdamW skips it, weight decay included.
    model = Branchy()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = sum(model(sharded_batch(data, r, nodes, s, batch)) for r in range(nodes)) / nodes
        loss.backward()
        assert model.unused.weight.grad is None and model.partial.weight.grad is not None
        opt.step()
    assert_params_close(result.model, [p.detach() for p in model.parameters()])
    untouched = Branchy()
    assert torch.equal(result.model.unused.weight, untouched.unused.weight)
    assert torch.equal(result.model.unused.bias, untouched.unused.bias)
    assert not torch.equal(result.model.partial.weight, untouched.partial.weight)  # node 0's gradient
    # On every node: grad None exactly for the unused branch, and identical replicas.
    names = [n for n, _ in Branchy().named_parameters()]
    for s in range(steps):
        for r in range(nodes):
            none = {n for n, is_none in zip(names, _GradRecordingDDP.none[(r, s)], strict=True) if is_none}
            assert none == {"unused.weight", "unused.bias"}, (r, s)
            for a, b in zip(_GradRecordingDDP.params_after[(0, s)], _GradRecordingDDP.params_after[(r, s)],
                            strict=True):
                assert torch.equal(a, b), (r, s)


def test_demo_leaves_parameters_without_gradients_untouched(tmp_path):
    """One node, full top-k, no decay: DeMo is sign-SGD with decoupled weight decay
    (p *= 1 - lr wd; p -= lr sign(g)) on parameters that have a gradient, and a torch-style
    optimizer skips those without one."""
    steps, batch, lr, wd = 5, 4, 0.01, 0.5
    data = marked_data(steps * batch, 1)
    strategy = DeMo(lr=lr, compression_decay=0.0, compression_topk=16, compression_chunk=4,
                    weight_decay=wd)
    result = fit(Branchy(), data, strategy, tmp_path, nodes=1, max_steps=steps, batch_size=batch)
    model = Branchy()
    for s in range(steps):
        model.zero_grad(set_to_none=True)
        model(sharded_batch(data, 0, 1, s, batch)).backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is None:
                    continue
                p.mul_(1 - lr * wd)
                p.sub_(torch.sign(p.grad), alpha=lr)
    assert_params_close(result.model, [p.detach() for p in model.parameters()])
    assert torch.equal(result.model.unused.weight, Branchy().unused.weight)


class _CheckedDeMo(DeMo):
    """DeMo that gathers every node's weights after each step (unrecorded) to compare them."""

    spread: dict[int, float] = {}

    def after_optimizer_step(self, step):
        super().after_optimizer_step(step)
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        everyone = self.comm.all_gather(flat, record=False)
        _CheckedDeMo.spread[step] = max(float((x - everyone[0]).abs().max()) for x in everyone)


def test_demo_on_nodes_with_partial_and_missing_gradients(tmp_path):
    nodes, steps, batch = 3, 5, 4
    data = marked_data(nodes * batch * steps, nodes)
    _CheckedDeMo.spread.clear()
    result = fit(Branchy(), data, _CheckedDeMo(lr=0.01, compression_topk=2, compression_chunk=4,
                                               weight_decay=0.5),
                 tmp_path, nodes=nodes, max_steps=steps, batch_size=batch)
    untouched = Branchy()
    assert torch.equal(result.model.unused.weight, untouched.unused.weight)
    assert torch.equal(result.model.unused.bias, untouched.unused.bias)
    assert not torch.equal(result.model.partial.weight, untouched.partial.weight)  # node 0's momentum
    assert max(_CheckedDeMo.spread.values()) == 0.0  # replicas identical on every node


# -------------------------------------------------------------------------------- DeMo
class DoubleMLP(MLP):
    """The MLP in float64, so two DCT implementations agree to ~1e-15 and pick the same top-k."""

    def __init__(self) -> None:
        super().__init__()
        self.double()

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return super().forward(tuple(t.double() for t in batch))


def largest_divisor(n: int, limit: int) -> int:
    return next(d for d in range(min(n, limit), 0, -1) if n % d == 0)


def blocks_of(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """Chunks of a parameter as (blocks, rows, cols): 2-D (rows, rest) or one row for 1-D."""
    m = x.reshape(x.shape[0], -1) if x.dim() >= 2 else x.reshape(1, -1)
    rows, cols = m.shape
    r = largest_divisor(rows, chunk) if x.dim() >= 2 else 1
    c = largest_divisor(cols, chunk)
    blocks = m.reshape(rows // r, r, cols // c, c).permute(0, 2, 1, 3).reshape(-1, r, c)
    return blocks, (rows, cols, r, c)


def unblock(blocks: torch.Tensor, geometry: tuple[int, int, int, int], shape: torch.Size) -> torch.Tensor:
    rows, cols, r, c = geometry
    return blocks.reshape(rows // r, cols // c, r, c).permute(0, 2, 1, 3).reshape(shape)


def dct(blocks: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(scipy.fft.dctn(blocks.numpy(), axes=(1, 2), norm="ortho"))


def idct(blocks: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(scipy.fft.idctn(blocks.numpy(), axes=(1, 2), norm="ortho"))


def reference_demo(data, nodes, steps, batch, *, lr, decay, topk, chunk, wd) -> nn.Module:
    """DeMo (Peng et al. 2024, bloc97/DeMo) on ``nodes`` nodes, with scipy's orthonormal DCT:
    per node delta = decay delta + lr g; q = top-k by magnitude of each chunk's DCT;
    delta -= IDCT(q); every node then averages each coefficient over the nodes that sent it
    and applies p = p (1 - lr wd) - lr sign(IDCT(average))."""
    model = DoubleMLP()
    params = list(model.parameters())
    deltas = [[torch.zeros_like(p) for p in params] for _ in range(nodes)]
    for s in range(steps):
        sums = [None] * len(params)
        counts = [None] * len(params)
        for r in range(nodes):
            model.zero_grad()
            model(sharded_batch(data, r, nodes, s, batch)).backward()
            for i, p in enumerate(params):
                delta = deltas[r][i]
                delta.mul_(decay).add_(p.grad, alpha=lr)
                blocks, geometry = blocks_of(delta, chunk)
                coeffs = dct(blocks).reshape(blocks.shape[0], -1)
                idx = coeffs.abs().topk(min(topk, coeffs.shape[1]), dim=1).indices
                q = torch.zeros_like(coeffs).scatter(1, idx, coeffs.gather(1, idx))
                delta.sub_(unblock(idct(q.reshape(blocks.shape)), geometry, delta.shape))
                sent = torch.zeros_like(coeffs).scatter(1, idx, 1.0)
                sums[i] = q if sums[i] is None else sums[i] + q
                counts[i] = sent if counts[i] is None else counts[i] + sent
        with torch.no_grad():
            for i, p in enumerate(params):
                blocks, geometry = blocks_of(p.detach(), chunk)
                average = (sums[i] / counts[i].clamp(min=1)).reshape(blocks.shape)
                decoded = unblock(idct(average), geometry, p.shape)
                p.mul_(1 - lr * wd).sub_(torch.sign(decoded), alpha=lr)
    return model


@pytest.mark.parametrize(("topk", "decay", "wd"), [(3, 0.9, 0.1), (5, 0.999, 0.0)])
def test_demo_matches_a_scipy_dct_reference(topk, decay, wd, tmp_path):
    nodes, steps, batch, lr, chunk = 3, 6, 4, 0.01, 4
    data = regression_data(nodes * batch * steps)
    strategy = DeMo(lr=lr, compression_decay=decay, compression_topk=topk, compression_chunk=chunk,
                    weight_decay=wd)
    result = fit(DoubleMLP(), data, strategy, tmp_path, nodes=nodes, max_steps=steps, batch_size=batch)
    expected = reference_demo(data, nodes, steps, batch, lr=lr, decay=decay, topk=topk, chunk=chunk,
                              wd=wd)
    assert_params_close(result.model, [p.detach() for p in expected.parameters()], rtol=0, atol=1e-12)
    assert_params_differ(result.model, [p.detach() for p in DoubleMLP().parameters()])


# ------------------------------------------------------------------------ DiLoCo (+ SPARTA)
def reference_diloco(data, nodes, steps, batch, *, H, inner_lr, outer_lr, momentum, picks=None,
                     sparse_interval=1) -> list[torch.Tensor]:
    """DiLoCo (Douillard et al. 2023) on ``nodes`` nodes, plain torch.

    Every node runs inner AdamW steps (wd 0.1, betas 0.9/0.95, state never reset) from theta.
    Every H steps and after the last one: delta = theta - mean_i(theta_i), theta.grad = delta,
    one outer Nesterov SGD step, every node restarts from theta. With ``picks`` (SPARTA +
    DiLoCo), every ``sparse_interval`` steps the picked elements of each tensor are first
    replaced by their mean over the nodes.
    """
    models = [MLP() for _ in range(nodes)]
    inner = [torch.optim.AdamW(m.parameters(), lr=inner_lr, weight_decay=0.1, betas=(0.9, 0.95))
             for m in models]
    theta = [p.detach().clone().requires_grad_(True) for p in MLP().parameters()]
    outer = torch.optim.SGD(theta, lr=outer_lr, momentum=momentum, nesterov=True)

    def outer_step() -> None:
        with torch.no_grad():
            for i, t in enumerate(theta):
                t.grad = t - torch.stack([list(m.parameters())[i].detach() for m in models]).mean(0)
        outer.step()
        with torch.no_grad():
            for m in models:
                for p, t in zip(m.parameters(), theta, strict=True):
                    p.copy_(t)

    for s in range(steps):
        for r, (m, opt) in enumerate(zip(models, inner, strict=True)):
            opt.zero_grad()
            m(sharded_batch(data, r, nodes, s, batch)).backward()
            opt.step()
        if picks is not None and (s + 1) % sparse_interval == 0:
            with torch.no_grad():
                for i, tensors in enumerate(zip(*[list(m.parameters()) for m in models], strict=True)):
                    ix = picks[s // sparse_interval][i]
                    mean = torch.stack([t.view(-1)[ix] for t in tensors]).mean(0)
                    for t in tensors:
                        t.view(-1)[ix] = mean
        if (s + 1) % H == 0 or s == steps - 1:
            outer_step()
    return [t.detach() for t in theta]


@pytest.mark.parametrize("steps", [9, 10])  # 10: a final sync after a short round
def test_diloco_matches_the_reference(steps, tmp_path):
    nodes, batch, H = 3, 4, 3
    data = regression_data(nodes * batch * steps)
    result = fit(MLP(), data, DiLoCo(H=H, lr=0.01), tmp_path, nodes=nodes, max_steps=steps,
                 batch_size=batch)
    expected = reference_diloco(data, nodes, steps, batch, H=H, inner_lr=0.01, outer_lr=0.7,
                                momentum=0.9)
    assert_params_close(result.model, expected)


def test_sparta_diloco_matches_the_reference(tmp_path):
    nodes, steps, batch, H, interval, p, seed = 3, 10, 4, 4, 2, 0.3, 7
    data = regression_data(nodes * batch * steps)
    strategy = SPARTADiLoCo(p=p, sparse_interval=interval, H=H, lr=0.01)
    result = fit(MLP(), data, strategy, tmp_path, nodes=nodes, max_steps=steps, batch_size=batch,
                 seed=seed)
    module = sparse_module(p, seed=seed)
    shapes = [t.numel() for t in MLP().parameters()]
    picks = [[module.indices(r, i, n) for i, n in enumerate(shapes)] for r in range(steps // interval)]
    expected = reference_diloco(data, nodes, steps, batch, H=H, inner_lr=0.01, outer_lr=0.7,
                                momentum=0.9, picks=picks, sparse_interval=interval)
    assert_params_close(result.model, expected)
    plain = reference_diloco(data, nodes, steps, batch, H=H, inner_lr=0.01, outer_lr=0.7, momentum=0.9)
    assert_params_differ(result.model, plain)  # the sparse averages changed the trajectory
