"""--balance: shares by throughput, and sample-weighted means checked against plain torch.

The references below are the algorithms written out with torch tensors, one model per node
(or one model over the whole global batch for DDP), without meshtrain's helpers. Node r
reads its shard (every nodes-th sample from r) in order, ``b_r`` samples a step.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers import MLP, regression_data
from torch.testing import assert_close
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

from meshtrain import Trainer, observers
from meshtrain.cli.main import app
from meshtrain.data import NodeBatches
from meshtrain.engine import balance as balance_module
from meshtrain.engine.balance import Balancer, apportion, simulated_shares
from meshtrain.errors import SettingError
from meshtrain.strategies import DDP, DeMo, DiLoCo, FedAvg, SPARTADiLoCo

TOL = dict(rtol=1e-5, atol=1e-6)
SLOW = ["node=1,slowdown=3"]  # speeds 1 and 1/3: a global batch of 16 splits 12 / 4


def fit(strategy, data, tmp_path, **kwargs):
    kwargs.setdefault("shuffle", False)
    kwargs.setdefault("progress", False)
    return Trainer(MLP(), data).fit(strategy, out_dir=tmp_path, **kwargs)


def shard_batch(data: TensorDataset, rank: int, nodes: int, step: int, size: int) -> list[torch.Tensor]:
    """Batch ``step`` of ``size`` samples from node ``rank``'s shard, read in order."""
    usable = len(data) - len(data) % nodes
    shard = [t[rank:usable:nodes] for t in data.tensors]
    per_epoch = len(shard[0]) // size
    start = (step % per_epoch) * size
    return [t[start : start + size] for t in shard]


def assert_params(model, expected, **tol) -> None:
    for p, e in zip(model.parameters(), expected, strict=True):
        assert_close(p.detach(), e, **(tol or TOL))


def differ(model, other) -> bool:
    return any(not torch.allclose(p.detach(), o, **TOL) for p, o in zip(model.parameters(), other,
                                                                           strict=True))


# ------------------------------------------------------------------------------ shares
def test_apportion_is_proportional_sums_exactly_and_gives_everyone_a_sample():
    assert apportion(16, [1.0, 1 / 3]) == [12, 4]
    assert apportion(16, [1.0, 0.5]) == [11, 5]  # 10.67 / 5.33: the larger remainder gets it
    assert apportion(10, [1.0, 1.0, 1.0]) == [4, 3, 3]  # ties go to the lower rank
    assert apportion(4, [1000.0, 1.0, 1.0]) == [2, 1, 1]  # at least one each, still summing to 4
    for total, speeds in [(97, [3.1, 0.2, 7.7, 1.0]), (8, [1e-6, 1.0]), (5, [1.0] * 5)]:
        sizes = apportion(total, speeds)
        assert sum(sizes) == total and min(sizes) >= 1
    with pytest.raises(ValueError, match="cannot give each of 3 nodes"):
        apportion(2, [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="finite numbers > 0"):
        apportion(8, [1.0, 0.0])


class _TwoRanks:
    """Rank 0 of two, for a Balancer alone: its peer always reports ``peer`` samples/s, and
    steps as long as its share at that speed takes (``balancer`` gives the share)."""

    rank, world_size = 0, 2

    def __init__(self, peer: float) -> None:
        self.peer = peer
        self.log = SimpleNamespace(seconds=0.0)  # never waits: every second is compute
        self.balancer: Balancer | None = None

    def all_gather(self, mine: torch.Tensor, *, record: bool = True) -> list[torch.Tensor]:
        assert not record  # the shares' exchange is not training traffic
        shares = self.balancer.shares if self.balancer is not None else None
        batch = shares.batch_sizes[1] if shares is not None else 256
        return [mine, torch.tensor([self.peer, self.peer, batch / self.peer], dtype=torch.float64)]


def test_measured_shares_recover_within_steps_from_a_slowed_warm_up(monkeypatch):
    # Rank 0 computes 4,000 samples/s, its peer 2,000; something else on rank 0's host slows
    # its timed warm-up steps to 1,000. The later windows are 5, 10, then 20 steps, so the
    # wrong shares it starts with are set again after 5 steps and favour rank 0 after 15.
    now = [0.0]
    monkeypatch.setattr(balance_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    comm = _TwoRanks(peer=2000.0)
    batches = NodeBatches(TensorDataset(torch.zeros(4096, 1)), rank=0, nodes=2, batch_size=256, seed=0,
                          shuffle=False, shard=True)
    strategy = SimpleNamespace(sample_weight=None)
    balancer = Balancer(comm, 2, 256, measured=True, stragglers={}, sync_interval=1)  # type: ignore[arg-type]
    comm.balancer = balancer
    changed = {}
    for step in range(80):
        now[0] += batches.batch_size / (1000.0 if 1 <= step <= 5 else 4000.0)
        if balancer.step_done(step, batches, strategy):  # type: ignore[arg-type]
            changed[step + 1] = batches.batch_size
    assert list(changed) == [6, 11, 21, 41, 61], changed  # 1-based steps after which they changed
    assert changed[6] < 256 < changed[21], changed  # 1,000 vs 2,000, then most of the truth
    speed = balancer.shares.throughputs[0]
    assert 0.9 * 4000 < speed < 4000, balancer.shares  # the warm-up still counts, a 16th as much
    assert strategy.sample_weight == changed[61]


class _LyingPeer:
    """Rank 0 of two whose peer computes ``actual`` samples/s and claims ``claimed`` (its
    step time is what it truly took). Every step lasts as long as the slower rank's compute:
    rank 0 waits the rest inside the all-reduce (its log's seconds), as on real hosts."""

    rank, world_size = 0, 2

    def __init__(self, actual: float, claimed: float) -> None:
        self.actual, self.claimed = actual, claimed
        self.log = SimpleNamespace(seconds=0.0)
        self.balancer: Balancer | None = None

    def peer_batch(self) -> int:
        shares = self.balancer.shares if self.balancer is not None else None
        return shares.batch_sizes[1] if shares is not None else 256

    def all_gather(self, mine: torch.Tensor, *, record: bool = True) -> list[torch.Tensor]:
        return [mine, torch.tensor([self.claimed, self.claimed, float(mine[2])], dtype=torch.float64)]


def _run_beside(peer: _LyingPeer, monkeypatch, steps: int = 40) -> tuple[Balancer, list[int]]:
    """Rank 0 (1,000 samples/s) trains ``steps`` steps with --balance beside ``peer``."""
    now = [0.0]
    monkeypatch.setattr(balance_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    batches = NodeBatches(TensorDataset(torch.zeros(4096, 1)), rank=0, nodes=2, batch_size=256, seed=0,
                          shuffle=False, shard=True)
    strategy = SimpleNamespace(sample_weight=None)
    balancer = Balancer(peer, 2, 256, measured=True, stragglers={}, sync_interval=1)  # type: ignore[arg-type]
    peer.balancer = balancer
    sizes = []
    for step in range(steps):
        mine, theirs = batches.batch_size / 1000.0, peer.peer_batch() / peer.actual
        now[0] += max(mine, theirs)
        peer.log.seconds += max(0.0, theirs - mine)  # rank 0 waits for the slower peer
        balancer.step_done(step, batches, strategy)  # type: ignore[arg-type]
        sizes.append(batches.batch_size)
    return balancer, sizes


@pytest.mark.parametrize("claim", [1e308, float("nan"), float("inf"), -5.0, 0.0])
def test_a_claim_that_is_no_speed_is_refused_naming_the_rank(claim, monkeypatch, capsys):
    """1e308 samples/s crashed both ranks with OverflowError, NaN with ValueError."""
    balancer, sizes = _run_beside(_LyingPeer(actual=1000.0, claimed=claim), monkeypatch, steps=10)
    assert balancer.refused is not None and balancer.refused.startswith("rank 1 "), balancer.refused
    assert set(sizes) == {256}  # the honest split, and no more claims taken
    assert balancer.to_dict()["refused"] == balancer.refused
    assert capsys.readouterr().err == f"warning: --balance: {balancer.refused}\n"


def test_a_five_fold_lie_is_refused_by_the_steps_every_rank_times(monkeypatch):
    """The peer computes as fast as rank 0 but claims 5x: it took 427 of 512 samples and
    every step then took 1.7x as long (the honest host waited most of it)."""
    balancer, sizes = _run_beside(_LyingPeer(actual=1000.0, claimed=5000.0), monkeypatch)
    assert balancer.refused == ("rank 1's claimed speed gave it 427 of 512 samples a step, and the steps "
                                "then took 1.7x as long as with equal shares: its claims are refused, every "
                                "node takes equal shares"), balancer.refused
    assert sizes[5] == 85 and sizes[-1] == 256 and balancer.shares.batch_sizes == (256, 256), sizes


def test_a_truly_faster_peer_keeps_its_larger_share(monkeypatch):
    balancer, sizes = _run_beside(_LyingPeer(actual=3000.0, claimed=3000.0), monkeypatch)
    assert balancer.refused is None
    assert balancer.shares.batch_sizes == (128, 384), balancer.shares


def test_a_claim_of_more_compute_than_the_step_lasted_is_refused(monkeypatch):
    """A rank may not say it computed longer than the step every rank timed."""
    peer = _LyingPeer(actual=1000.0, claimed=10.0)  # 256 samples at 10/s: 25.6 s in 0.256 s steps
    balancer, sizes = _run_beside(peer, monkeypatch, steps=10)
    assert balancer.refused is not None and balancer.refused.startswith(
        "rank 1 claimed 10 samples/s: its 256 samples would take 25.6 s, where its steps took 0.256 s")


def test_simulated_shares_follow_the_stragglers():
    shares = simulated_shares(3, 8, {2: 2.0})
    assert shares.batch_sizes == (10, 9, 5) and shares.uneven
    assert shares.work(8) == {0: 10 / 8, 1: 9 / 8, 2: 5 / 8}
    assert not simulated_shares(4, 8, {}).uneven


# ------------------------------------------------------------ the math against plain torch
def reference_ddp(data, sizes, steps, lr, *, weighted=True):
    """One model, SGD on the mean loss over the global batch (all nodes' samples at once);
    ``weighted=False`` builds the wrong answer (the plain mean of the nodes' mean losses)."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    nodes = len(sizes)
    for s in range(steps):
        opt.zero_grad()
        batches = [shard_batch(data, r, nodes, s, b) for r, b in enumerate(sizes)]
        if weighted:
            model((torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))).backward()
        else:
            (sum(model(b) for b in batches) / nodes).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_balanced_ddp_is_one_model_on_the_whole_global_batch(tmp_path):
    data, steps = regression_data(320), 6
    result = fit(DDP(optim="sgd", lr=0.1), data, tmp_path, nodes=2, steps=steps, batch_size=8,
                 balance=True, straggler=SLOW)
    assert result.summary["balance"]["nodes"][1]["batch_size"] == 4
    assert_params(result.model, reference_ddp(data, [12, 4], steps, 0.1))
    assert differ(result.model, reference_ddp(data, [12, 4], steps, 0.1, weighted=False))


def reference_local(data, sizes, steps, *, H, inner, outer_lr, momentum):
    """DiLoCo (outer Nesterov SGD on the b-weighted pseudo-gradient) or, with outer_lr=1 and
    momentum=0, FedAvg: the parameters averaged with weights b_r every H steps."""
    nodes, total = len(sizes), sum(sizes)
    models = [MLP() for _ in range(nodes)]
    opts = [inner(m.parameters()) for m in models]
    theta = [p.detach().clone().requires_grad_(True) for p in MLP().parameters()]
    outer = torch.optim.SGD(theta, lr=outer_lr, momentum=momentum, nesterov=momentum > 0)
    for s in range(steps):
        for r, (m, opt) in enumerate(zip(models, opts, strict=True)):
            opt.zero_grad()
            m(shard_batch(data, r, nodes, s, sizes[r])).backward()
            opt.step()
        if (s + 1) % H == 0 or s == steps - 1:
            with torch.no_grad():
                for i, t in enumerate(theta):
                    mean = sum(b * list(m.parameters())[i].detach() for b, m in zip(sizes, models,
                                                                                      strict=True))
                    t.grad = t - mean / total
            outer.step()
            with torch.no_grad():
                for m in models:
                    for p, t in zip(m.parameters(), theta, strict=True):
                        p.copy_(t)
    return [t.detach() for t in theta]


@pytest.mark.parametrize("runtime", ["threads", "processes"])
def test_balanced_diloco_weights_each_pseudo_gradient_by_its_samples(runtime, tmp_path):
    data, steps, H = regression_data(640), 7, 3  # a final sync after a short round
    result = fit(DiLoCo(H=H, lr=0.01), data, tmp_path, nodes=2, steps=steps, batch_size=8,
                 balance=True, straggler=SLOW, runtime=runtime)
    adamw = lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, betas=(0.9, 0.95))  # noqa: E731
    expected = reference_local(data, [12, 4], steps, H=H, inner=adamw, outer_lr=0.7, momentum=0.9)
    assert_params(result.model, expected)


@pytest.mark.parametrize("weighted", [False, True])  # balance weighs by samples seen either way
def test_balanced_fedavg_averages_parameters_weighted_by_samples(weighted, tmp_path):
    data, steps, H = regression_data(640), 6, 2
    result = fit(FedAvg(H=H, optim="sgd", lr=0.05, weighted=weighted), data, tmp_path, nodes=2,
                 steps=steps, batch_size=8, balance=True, straggler=SLOW)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.05)  # noqa: E731
    assert_params(result.model, reference_local(data, [12, 4], steps, H=H, inner=sgd, outer_lr=1.0,
                                                momentum=0.0))


def test_weighting_changes_the_result_the_reference_can_tell(tmp_path):
    """The DiLoCo reference with plain means differs from the weighted one, so the tests
    above would catch a run that forgot the weights."""
    data, steps, H = regression_data(640), 6, 3
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.05)  # noqa: E731
    weighted = reference_local(data, [12, 4], steps, H=H, inner=sgd, outer_lr=0.7, momentum=0.9)
    result = fit(DiLoCo(H=H, optim="sgd", lr=0.05), data, tmp_path, nodes=2, steps=steps,
                 batch_size=8, balance=True, straggler=SLOW)
    assert_params(result.model, weighted)
    plain = fit(DiLoCo(H=H, optim="sgd", lr=0.05), data, tmp_path / "plain", nodes=2, steps=steps,
                batch_size=8)
    assert differ(plain.model, weighted)


def test_sparta_diloco_runs_balanced_and_ends_in_sync(tmp_path):
    data = regression_data(640)
    result = fit(SPARTADiLoCo(p=0.3, sparse_interval=2, H=4, lr=0.01), data, tmp_path, nodes=3,
                 steps=8, batch_size=8, balance=True, straggler=["node=2,slowdown=2"], check_sync=True)
    assert [n["batch_size"] for n in result.summary["balance"]["nodes"]] == [10, 9, 5]


# ------------------------------------------------------------------- unbalanced runs unchanged
@pytest.mark.parametrize("strategy", [DDP(lr=0.05), DiLoCo(H=2, lr=0.01), FedAvg(H=2, weighted=True)],
                         ids=["ddp", "diloco", "fedavg"])
def test_balance_with_equal_nodes_is_bit_identical_to_no_balance(strategy, tmp_path):
    data = regression_data(320)
    plain = fit(strategy, data, tmp_path / "a", nodes=2, steps=5, batch_size=8, shuffle=True)
    even = fit(strategy, data, tmp_path / "b", nodes=2, steps=5, batch_size=8, shuffle=True,
               balance=True)
    for p, q in zip(plain.model.parameters(), even.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert [n["batch_size"] for n in even.summary["balance"]["nodes"]] == [8, 8]
    assert "balance" not in plain.summary


# --------------------------------------------------------------- the straggler gets less work
def test_balance_gives_the_slow_node_a_smaller_share_and_ends_the_waiting(tmp_path):
    data, val = regression_data(1600), regression_data(200, seed=5)
    runs = {}
    for balance in (False, True):
        runs[balance] = Trainer(MLP(), data, val_data=val).fit(
            DDP(lr=0.02), nodes=2, steps=40, batch_size=16, straggler=["node=1,slowdown=2"],
            balance=balance, out_dir=tmp_path / str(balance), progress=False, step_seconds=0.1)
    waiting = {b: r.summary["projected"]["idle_seconds"] / r.summary["projected"]["compute_seconds"]
               for b, r in runs.items()}
    assert waiting[False] == pytest.approx(0.5)  # the fast node waits half of every step
    assert waiting[True] < 0.1  # shares 21 / 11 of 32: 0.0625 of a 1.375-step wait
    shares = runs[True].summary["balance"]["nodes"]
    assert [s["batch_size"] for s in shares] == [21, 11] and shares[1]["relative_speed"] == 0.5
    # Samples seen stay the same, and so does the validation loss they reach.
    assert runs[True].summary["examples"] == runs[False].summary["examples"]
    final = {b: r.summary["final_val_loss"] for b, r in runs.items()}
    assert final[True] == pytest.approx(final[False], rel=0.05)
    config = yaml.safe_load((runs[True].run_dir / "config.yaml").read_text())
    assert config["train"]["balance"] is True
    assert config["balance"] == runs[True].summary["balance"]


# ------------------------------------------------------------------------------ refusals
def test_balance_is_refused_where_it_cannot_hold(tmp_path):
    data = regression_data(320)
    with pytest.raises(SettingError, match="balance: strategy demo does not weight"):
        fit(DeMo(), data, tmp_path, nodes=2, steps=2, batch_size=8, balance=True)
    with pytest.raises(SettingError, match="balance cannot be combined with --fail"):
        fit(DDP(), data, tmp_path, nodes=3, steps=4, batch_size=8, balance=True,
            fail=["node=2,step=2"])


@pytest.mark.parametrize(("command", "message"), [
    (["simulate", "--strategy", "demo"], "balance: strategy demo does not weight its averages"),
    (["simulate", "--strategy", "examples.custom_strategy:Int8DDP"],  # averages by itself
     "balance: strategy int8-ddp does not weight its averages"),
    (["simulate", "--fail", "node=1,step=2", "--nodes", "3"], "balance cannot be combined with --fail"),
    (["launch", "INVENTORY", "--max-restarts", "1", "--checkpoint-every", "5"],
     "--balance cannot be combined with --resume or --max-restarts yet"),
    (["launch", "INVENTORY", "--strategy", "demo"], "balance: strategy demo does not weight"),
])
def test_balance_refusals_are_one_line_and_exit_2(command, message, tmp_path):
    inventory = tmp_path / "hosts.yaml"  # never contacted: the flags fail first (loopback anyway)
    inventory.write_text("defaults: {python: /usr/bin/python3, workdir: /tmp/mt}\n"
                         "hosts:\n  - {name: a, host: 127.0.0.1}\n  - {name: b, host: 127.0.0.1, port: 2}\n")
    args = [str(inventory) if a == "INVENTORY" else a for a in command]
    done = CliRunner().invoke(app, [*args, "--balance", "--steps", "4", "--out", str(tmp_path / "runs")])
    assert done.exit_code == 2, done.output
    assert message in done.output
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_simulate_prints_and_records_the_shares(tmp_path):
    done = CliRunner().invoke(app, ["simulate", "--strategy", "ddp", "--nodes", "2", "--steps", "3",
                                    "--straggler", "node=1,slowdown=2", "--balance", "--no-progress",
                                    "--out", str(tmp_path), "--run-id", "b"])
    assert done.exit_code == 0, done.output
    assert "node 0 43 (67%), node 1 21 (33%)" in done.output  # batch 32 per node: 64 split 2:1
    config = yaml.safe_load((tmp_path / "b" / "config.yaml").read_text())
    assert config["spec"]["balance"] is True and config["balance"]["nodes"][1]["batch_size"] == 21


def test_observers_see_each_nodes_samples_per_step(tmp_path):
    """What feeds `simulate --dashboard`: every node's updates carry its share."""
    seen: dict[int, set] = {0: set(), 1: set()}

    class Watcher:
        def __getattr__(self, name):
            return lambda *args: None

        def node_update(self, update):
            seen[update.node].add(update.batch_size)

    with observers.watching(Watcher()):
        fit(DDP(), regression_data(400), tmp_path, nodes=2, steps=3, batch_size=8, balance=True,
            straggler=SLOW)
    assert seen == {0: {12}, 1: {4}}


def test_a_refused_claim_names_the_host_where_the_launcher_said_which(monkeypatch):
    monkeypatch.setenv("MESHTRAIN_HOST_NAMES", "studio,air")
    balancer, _ = _run_beside(_LyingPeer(actual=1000.0, claimed=float("nan")), monkeypatch, steps=10)
    assert balancer.refused is not None and balancer.refused.startswith(
        "rank 1 (air) reported a speed of nan, not a finite number > 0"), balancer.refused
