"""Byte accounting equals the closed-form traffic of each strategy."""

from __future__ import annotations

import pytest
import torch
from helpers import MLP, Sized, regression_data, unequal_factory

from meshtrain import Trainer
from meshtrain.comm import ThreadCommunicator, ThreadHub, ring_all_reduce_bytes
from meshtrain.comm.communicator import ring_chunk_sizes
from meshtrain.strategies import DDP, SPARTA, DeMo, DiLoCo, FedAvg, SPARTADiLoCo, Strategy

F32 = 4
F64 = 8


@pytest.fixture
def comms(monkeypatch):
    """Every node's communicator of the runs in a test (threads runtime), by rank."""
    seen: dict[int, object] = {}
    original = Strategy.setup

    def setup(self, model, comm, **kwargs):
        seen[comm.rank] = comm
        original(self, model, comm, **kwargs)

    monkeypatch.setattr(Strategy, "setup", setup)
    return seen


def run(strategy, tmp_path, *, nodes, steps, model=None, data=None, **kwargs):
    kwargs.setdefault("batch_size", 4)
    return Trainer(model or Sized(), data or regression_data(96)).fit(
        strategy, nodes=nodes, max_steps=steps, out_dir=tmp_path, progress=False, **kwargs)


def ring_mean(numel: int, nodes: int, element_size: int = F32) -> float:
    """Per-node mean of a ring all-reduce's bytes sent: 2 (n-1)/n * S."""
    return 2 * (nodes - 1) / nodes * numel * element_size


def check_totals(result):
    summary, history = result.summary, result.history
    assert summary["bytes_sent_per_node"] == pytest.approx(sum(r["bytes_sent"] for r in history))
    assert summary["bytes_received_per_node"] == pytest.approx(sum(r["bytes_received"] for r in history))
    assert history[-1]["total_bytes_sent"] == pytest.approx(summary["bytes_sent_per_node"])


# ------------------------------------------------------------------------- ring formula
@pytest.mark.parametrize(
    ("numel", "g", "pos", "sent", "received"),
    [
        (12, 4, 0, 18, 18),  # even: 2 (g-1)/g * numel elements both ways
        (10, 3, 0, 14, 13),  # chunks [4, 3, 3]: sends all but chunks 1 and 2, receives all but 0 and 1
        (10, 3, 1, 13, 14),  # sends all but chunks 2 and 0; receives all but 1 and 2
        (10, 3, 2, 13, 13),  # sends all but chunks 0 and 1; receives all but 2 and 0
        (5, 4, 3, 7, 7),  # chunks [2, 1, 1, 1]: skips chunks 0 and 1 sending, 3 and 0 receiving
        (2, 4, 1, 4, 3),  # fewer elements than nodes: chunks [1, 1, 0, 0]
        (7, 1, 0, 0, 0),  # alone: nothing moves
    ],
)
def test_ring_all_reduce_bytes_by_hand(numel, g, pos, sent, received):
    assert ring_all_reduce_bytes(numel, F32, pos, g) == (sent * F32, received * F32)
    assert ring_all_reduce_bytes(numel, 2, pos, g) == (sent * 2, received * 2)


@pytest.mark.parametrize(("numel", "g"), [(10, 3), (17, 4), (3, 5), (1000, 7)])
def test_ring_bytes_conserved_and_every_chunk_travels_2g_minus_2_times(numel, g):
    sent = [ring_all_reduce_bytes(numel, 1, p, g)[0] for p in range(g)]
    received = [ring_all_reduce_bytes(numel, 1, p, g)[1] for p in range(g)]
    assert sum(sent) == sum(received) == 2 * (g - 1) * numel
    assert ring_chunk_sizes(numel, g) == [len(c) for c in torch.arange(numel).tensor_split(g)]


# ------------------------------------------------------------------------- strategies
def test_ddp_bytes_per_step(tmp_path, comms):
    nodes, steps = 4, 5
    model = Sized(8, 6)  # 48 trainable floats (the frozen parameter is never sent)
    res = run(DDP("sgd", 0.1), tmp_path, nodes=nodes, steps=steps, model=model)
    # One bucket: the 48 gradient values and one has-gradient flag per tensor (1 tensor).
    per_step = 2 * (nodes - 1) / nodes * (48 + 1) * F32  # 294
    assert per_step == 294
    assert [r["bytes_sent"] for r in res.history] == [per_step] * steps
    assert [r["bytes_received"] for r in res.history] == [per_step] * steps
    assert res.summary["bytes_sent_per_node"] == per_step * steps
    check_totals(res)
    for rank, comm in comms.items():
        assert [(r.step, r.kind, r.group_size) for r in comm.log.records] == [
            (s, "all_reduce", nodes) for s in range(steps)
        ], rank
        # 49 values in chunks [13, 12, 12, 12]: each node exactly what its ring position sends.
        assert comm.log.bytes_sent == ring_all_reduce_bytes(49, F32, rank, nodes)[0] * steps


@pytest.mark.parametrize(("steps", "syncs"), [(9, [2, 5, 8]), (10, [2, 5, 8, 9])])
def test_diloco_bytes_every_h_steps_plus_final(steps, syncs, tmp_path, comms):
    nodes = 4
    res = run(DiLoCo(H=3, lr=0.01), tmp_path, nodes=nodes, steps=steps)
    full = ring_mean(48, nodes)
    assert [r["bytes_sent"] for r in res.history] == [full if s in syncs else 0 for s in range(steps)]
    assert res.summary["bytes_sent_per_node"] == full * len(syncs)
    check_totals(res)
    for comm in comms.values():
        assert [r.step for r in comm.log.records] == syncs
        assert {(r.kind, r.group_size) for r in comm.log.records} == {("all_reduce", nodes)}


def test_validation_traffic_is_not_counted(tmp_path):
    kw = dict(nodes=4, steps=6)
    plain = run(DiLoCo(H=2, lr=0.01), tmp_path / "a", **kw)
    validated = Trainer(Sized(), regression_data(96), regression_data(8)).fit(
        DiLoCo(H=2, lr=0.01), nodes=4, max_steps=6, batch_size=4, val_interval=1,
        out_dir=tmp_path / "b", progress=False)
    assert sum(r["val_loss"] is not None for r in validated.history) == 6
    assert [r["bytes_sent"] for r in validated.history] == [r["bytes_sent"] for r in plain.history]


def test_sparta_random_bytes(tmp_path, comms):
    nodes, steps, p = 4, 4, 0.25
    model = MLP()  # tensors of 48, 8, 16 and 2 values
    res = run(SPARTA(p=p, lr=0.01), tmp_path, nodes=nodes, steps=steps, model=model)
    k = sum(max(1, round(p * t.numel())) for t in model.parameters())
    assert k == 12 + 2 + 4 + 1  # round(0.5) == 0, and at least one value is sent
    sparse = ring_mean(k, nodes)  # 19 values split [5, 5, 5, 4]: the mean is still the formula
    full = ring_mean(sum(t.numel() for t in model.parameters()), nodes)
    expected = [sparse] * (steps - 1) + [sparse + full]  # the final full average of SPARTA
    assert [r["bytes_sent"] for r in res.history] == pytest.approx(expected)
    assert res.summary["bytes_sent_per_node"] == pytest.approx(sparse * steps + full)
    check_totals(res)
    # Per node the uneven chunks show: exactly what ring_all_reduce_bytes says for its position.
    for rank, comm in comms.items():
        sparse_records = comm.log.records[:steps]
        assert all(r.bytes_sent == ring_all_reduce_bytes(k, F32, rank, nodes)[0] for r in sparse_records)
        assert comm.log.records[-1].step == steps - 1 and len(comm.log.records) == steps + 1


def test_sparta_partitioned_bytes(tmp_path):
    nodes, steps = 4, 6
    res = run(SPARTA(p=0.25, selector="partitioned", lr=0.01), tmp_path, nodes=nodes, steps=steps)
    sparse, full = ring_mean(12, nodes), ring_mean(48, nodes)  # 48 / 4 partitions
    assert [r["bytes_sent"] for r in res.history] == [sparse] * (steps - 1) + [sparse + full]


def test_sparta_diloco_bytes(tmp_path):
    nodes, steps = 4, 8
    res = run(SPARTADiLoCo(p=0.25, sparse_interval=2, H=4, lr=0.01), tmp_path, nodes=nodes, steps=steps)
    sparse, full = ring_mean(12, nodes), ring_mean(48, nodes)
    expected = [0, sparse, 0, sparse + full, 0, sparse, 0, sparse + full]
    assert [r["bytes_sent"] for r in res.history] == expected


def test_fedavg_islands_cost_group_sized_traffic(tmp_path, comms):
    nodes, steps, island = 4, 6, 2
    res = run(FedAvg(H=2, island_size=island, lr=0.05), tmp_path, nodes=nodes, steps=steps)
    group = 2 * (island - 1) / island * 48 * F32  # 192: one island, not the cluster
    full = ring_mean(48, nodes)  # islands differ at the end: one full average
    assert [r["bytes_sent"] for r in res.history] == [0, group, 0, group, 0, group + full]
    check_totals(res)
    for comm in comms.values():
        assert [(r.step, r.kind, r.group_size) for r in comm.log.records] == [
            (1, "all_reduce", 2), (3, "all_reduce", 2), (5, "all_reduce", 2), (5, "all_reduce", 4)
        ]


def test_fedavg_islands_change_between_rounds():
    strategy = FedAvg(H=1, island_size=2)
    strategy.setup(Sized(), ThreadCommunicator(ThreadHub(4), 0), seed=0, max_steps=10)
    module = strategy.modules[0]
    rounds = [module.islands(r) for r in range(8)]
    for groups in rounds:
        assert sorted(sum(groups, [])) == [0, 1, 2, 3] and all(len(g) == 2 for g in groups)
    assert len({tuple(map(tuple, g)) for g in rounds}) > 1


def test_fedavg_weighted_islands_bytes(tmp_path, comms):
    nodes, steps, island = 4, 6, 2
    res = run(FedAvg(H=2, island_size=island, weighted=True, lr=0.05), tmp_path, nodes=nodes,
              steps=steps, data=unequal_factory)
    # Every average, the final full one included, carries the node's weight in its bucket.
    group = 2 * (island - 1) / island * (48 + 1) * F32
    full = ring_mean(48 + 1, nodes)
    assert [r["bytes_sent"] for r in res.history] == pytest.approx([0, group, 0, group, 0, group + full])
    check_totals(res)
    for comm in comms.values():
        assert [(r.step, r.kind, r.group_size) for r in comm.log.records] == [
            (1, "all_reduce", 2), (3, "all_reduce", 2), (5, "all_reduce", 2), (5, "all_reduce", 4)
        ]


def test_fedavg_weighted_bytes_include_the_weight(tmp_path):
    nodes = 3
    res = run(FedAvg(H=2, weighted=True, lr=0.05), tmp_path, nodes=nodes, steps=4, data=unequal_factory)
    per_sync = ring_mean(48 + 1, nodes)  # the weights travel in the same bucket
    assert [r["bytes_sent"] for r in res.history] == pytest.approx([0, per_sync, 0, per_sync])


def test_demo_bytes_all_gather_values_and_int16_indices(tmp_path, comms):
    nodes, steps, topk = 3, 3, 5
    # (8, 6) with chunk 4: chunks of 4 x 3 = 12 coefficients, 2 x 2 = 4 chunks -> 20 values.
    res = run(DeMo(lr=0.01, compression_topk=topk, compression_chunk=4), tmp_path, nodes=nodes,
              steps=steps, model=Sized(8, 6))
    k_total = 4 * topk
    flags = 1  # one int16 has-gradient flag per tensor rides with the indices
    per_step = (nodes - 1) * (k_total * (4 + 2) + flags * 2)
    assert [r["bytes_sent"] for r in res.history] == [per_step] * steps
    assert [r["bytes_received"] for r in res.history] == [per_step] * steps
    check_totals(res)
    for comm in comms.values():
        assert [(r.step, r.kind, r.group_size, r.bytes_sent) for r in comm.log.records] == [
            rec for s in range(steps)
            for rec in ((s, "all_gather", nodes, (nodes - 1) * k_total * 4),
                        (s, "all_gather", nodes, (nodes - 1) * (k_total + flags) * 2))
        ]


class SizedWithDoubleScale(Sized):
    """:class:`Sized` (float32) beside a float64 parameter of 4 values, as a model loaded
    in one precision with some layers kept in another has."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))

    def forward(self, batch):  # noqa: ANN001, ANN201 - a test model
        return super().forward(batch) * self.scale.mean().float()


def test_demo_with_two_parameter_dtypes_sends_each_at_its_own_width(tmp_path, comms):
    """Values of a float32 and a float64 parameter went in one concatenation, which widened
    the float32 ones to 8 bytes and then failed to add them into the float32 parameter."""
    nodes, steps, topk = 3, 2, 5
    res = run(DeMo(lr=0.01, compression_topk=topk, compression_chunk=4), tmp_path, nodes=nodes,
              steps=steps, model=SizedWithDoubleScale())
    k32, k64 = 4 * topk, 4  # the (8, 6) weight: 4 chunks x topk; the scale: one chunk of 4
    per_step = (nodes - 1) * (k32 * 4 + k64 * 8 + (k32 + k64 + 2) * 2)  # 2 int16 flags
    assert [r["bytes_sent"] for r in res.history] == [per_step] * steps
    for comm in comms.values():
        assert [(r.kind, r.bytes_sent) for r in comm.log.records] == [
            rec for _ in range(steps)
            for rec in (("all_gather", (nodes - 1) * k32 * 4), ("all_gather", (nodes - 1) * k64 * 8),
                        ("all_gather", (nodes - 1) * (k32 + k64 + 2) * 2))
        ]
    assert res.model.scale.dtype == torch.float64
    assert not torch.equal(res.model.scale, torch.ones(4, dtype=torch.float64))  # it trained


@pytest.mark.parametrize("runtime", ["threads", "processes", "vmap"])
def test_an_all_reduce_of_two_dtypes_sends_each_at_its_own_width(runtime, tmp_path):
    """DiLoCo's outer average of a float32 and a float64 parameter went in one flat bucket,
    which sent the 48 float32 values as float64 (416 bytes a sync instead of 224). Each
    dtype is now a bucket of its own, counted the same way in every runtime."""
    res = run(DiLoCo(H=2), tmp_path, nodes=2, steps=2, model=SizedWithDoubleScale(), runtime=runtime)
    assert [r["bytes_sent"] for r in res.history] == [0, ring_mean(48, 2) + ring_mean(4, 2, F64)]


@pytest.mark.parametrize("runtime", ["threads", "processes", "vmap"])
def test_ddp_buckets_hold_one_dtype_each(runtime, tmp_path):
    """DDP's gradient buckets mixed the float64 scale's gradient with the float32 weight's:
    the overlapped path (processes, real hosts) sent them all as float64 and the threads
    runtime's bucket buffer took the first tensor's dtype. A bucket now holds one dtype
    (torch DDP's rule), the has-gradient flags riding in the bucket of the first
    parameter's dtype: 48 weights + 2 flags at 4 bytes, 4 scales at 8."""
    steps = 2
    res = run(DDP(lr=0.01), tmp_path, nodes=2, steps=steps, model=SizedWithDoubleScale(), runtime=runtime,
              check_sync=True)
    assert [r["bytes_sent"] for r in res.history] == [ring_mean(48 + 2, 2) + ring_mean(4, 2, F64)] * steps
    assert res.model.scale.dtype == torch.float64 and res.model.weight.dtype == torch.float32


def test_ddp_with_two_dtypes_is_bit_identical_across_runtimes(tmp_path):
    """Each gradient is summed at its own precision on every runtime (3 nodes: a ring whose
    order matters), so threads and processes give the same weights bit for bit."""
    models = {runtime: run(DDP(lr=0.01), tmp_path / runtime, nodes=3, steps=3, model=SizedWithDoubleScale(),
                           runtime=runtime).model for runtime in ("threads", "processes")}
    for name, value in models["threads"].state_dict().items():
        assert torch.equal(value, models["processes"].state_dict()[name]), name


def test_a_broadcast_of_two_dtypes_sends_each_at_its_own_width():
    """Launch's replica check broadcasts rank 0's weights where replicas differ: one flat
    bucket of a float32 and a float64 tensor sent the float32 values as float64. Each dtype
    is now a bucket of its own; the vmap runtime counts the same."""
    import threading

    from meshtrain.comm.stacked import StackedCommunicator

    hub = ThreadHub(2)
    comms = [ThreadCommunicator(hub, rank) for rank in range(2)]
    held = [[torch.full((48,), float(rank)), torch.full((4,), float(rank), dtype=torch.float64)]
            for rank in range(2)]
    workers = [threading.Thread(target=comms[r].broadcast, args=(held[r],)) for r in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=30)
    assert all(torch.equal(t, torch.zeros_like(t)) for t in held[1])  # rank 0's values
    assert [t.dtype for t in held[1]] == [torch.float32, torch.float64]
    assert [r.bytes_sent for r in comms[0].log.records] == [48 * F32, 4 * F64]
    assert [r.bytes_received for r in comms[1].log.records] == [48 * F32, 4 * F64]

    stacked = StackedCommunicator(2)
    stacked.broadcast([torch.zeros(2, 48), torch.zeros(2, 4, dtype=torch.float64)])
    assert [r.bytes_sent for r in stacked.logs[0].records] == [48 * F32, 4 * F64]
    assert [r.bytes_received for r in stacked.logs[1].records] == [48 * F32, 4 * F64]


def test_single_node_sends_nothing(tmp_path):
    res = run(DDP("sgd", 0.1), tmp_path, nodes=1, steps=3)
    assert res.summary["bytes_sent_per_node"] == 0
    assert all(r["bytes_sent"] == 0 for r in res.history)
